//! Writes on the plugin's disk by somebody else: a thread appending fsync'd records to a
//! log, as etcd appends to its write-ahead log on a node that holds the API server (the
//! issue's single-node cluster). Stands in for that load; it is not etcd's I/O pattern in
//! detail (etcd batches, preallocates its segments and syncs with fdatasync, as here).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Bytes per record: a few KiB, about one small object write of etcd's.
pub(super) const RECORD: usize = 4096;
/// Records per log before it starts over (truncated), so the file stays small.
const RECORDS_PER_LOG: usize = 4096;
/// Pause between records.
pub(super) const PAUSE: Duration = Duration::from_millis(2);

/// A running writer; [`DiskWriter::stop`] ends it and says how many records it made durable.
pub(super) struct DiskWriter {
    stop: Arc<AtomicBool>,
    started: Instant,
    thread: JoinHandle<Result<u64>>,
}

/// What a writer did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Written {
    /// Records made durable.
    pub records: u64,
    /// Records per second over the writer's life.
    pub per_second: f64,
}

impl DiskWriter {
    /// Starts appending to `dir/disk-writer.log`.
    ///
    /// # Errors
    /// The log cannot be created.
    pub(super) fn start(dir: &Path) -> Result<Self> {
        let path = dir.join("disk-writer.log");
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| Error::io("create", &path, e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || write_until(&file, &path, &flag));
        Ok(DiskWriter {
            stop,
            started: Instant::now(),
            thread,
        })
    }

    /// Stops the writer.
    ///
    /// # Errors
    /// A write failed, or the thread panicked.
    pub(super) fn stop(self) -> Result<Written> {
        self.stop.store(true, Ordering::Relaxed);
        let records = self
            .thread
            .join()
            .map_err(|_| Error::Workload("the disk writer panicked".into()))??;
        // A count of records and seconds, far below 2^52.
        #[allow(clippy::cast_precision_loss)]
        let per_second = records as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
        Ok(Written {
            records,
            per_second,
        })
    }
}

fn write_until(mut file: &File, path: &Path, stop: &AtomicBool) -> Result<u64> {
    let record = vec![b'e'; RECORD];
    let mut records = 0u64;
    let mut in_log = 0usize;
    while !stop.load(Ordering::Relaxed) {
        if in_log == RECORDS_PER_LOG {
            file.set_len(0)
                .and_then(|()| std::io::Seek::rewind(&mut file))
                .map_err(|e| Error::io("truncate", path, e))?;
            in_log = 0;
        }
        file.write_all(&record)
            .map_err(|e| Error::io("write", path, e))?;
        file.sync_data().map_err(|e| Error::io("fsync", path, e))?;
        records += 1;
        in_log += 1;
        std::thread::sleep(PAUSE);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_makes_records_durable_until_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let writer = DiskWriter::start(dir.path()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let written = writer.stop().unwrap();
        assert!(written.records > 0, "{written:?}");
        let len = std::fs::metadata(dir.path().join("disk-writer.log"))
            .unwrap()
            .len();
        assert_eq!(len, written.records * RECORD as u64);
    }
}
