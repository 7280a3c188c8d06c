//! The floor of a prepare: the durable writes any prepare must make, done with nothing else.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Writes `contents` to `dir/name` the way a crash-safe writer must: a temporary file,
/// fdatasync, rename over the target, fsync of the directory. Written with std alone (not
/// through kerf-core), so the floor stays put when kerf's writer changes.
///
/// # Errors
/// A step fails.
pub(crate) fn durable_write(dir: &Path, name: &str, contents: &[u8]) -> Result<()> {
    let temp = dir.join(format!(".{name}.floor-tmp"));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&temp)
        .map_err(|e| Error::io("create", &temp, e))?;
    file.write_all(contents)
        .map_err(|e| Error::io("write", &temp, e))?;
    file.sync_data().map_err(|e| Error::io("fsync", &temp, e))?;
    drop(file);
    let target = dir.join(name);
    std::fs::rename(&temp, &target).map_err(|e| Error::io("rename", &target, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("fsync dir", dir, e))
}

/// The files one prepare writes durably, by size: the floor writes as many of the same sizes.
#[derive(Debug, Clone)]
pub(crate) struct FloorWrites {
    dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
}

impl FloorWrites {
    /// Floor writes of the given sizes into `dir` (created if missing), as files named
    /// `<prefix>-<n>.json`.
    ///
    /// # Errors
    /// `dir` cannot be created.
    pub(crate) fn new(dir: &Path, prefix: &str, sizes: &[usize]) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let files = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| (format!("{prefix}-{i}.json"), vec![b'x'; size]))
            .collect();
        Ok(FloorWrites {
            dir: dir.to_owned(),
            files,
        })
    }

    /// Makes every write once, one after another (as a prepare makes them).
    ///
    /// # Errors
    /// A write fails.
    pub(crate) fn write_all(&self) -> Result<()> {
        for (name, contents) in &self.files {
            durable_write(&self.dir, name, contents)?;
        }
        Ok(())
    }

    /// Writes every file as the plugin writes a CDI spec: a temporary file renamed over the
    /// target, without fsync.
    ///
    /// # Errors
    /// A file cannot be written or renamed.
    pub(crate) fn write_plain(&self) -> Result<()> {
        for (name, contents) in &self.files {
            let temp = self.dir.join(format!(".{name}.floor-tmp"));
            std::fs::write(&temp, contents).map_err(|e| Error::io("write", &temp, e))?;
            let target = self.dir.join(name);
            std::fs::rename(&temp, &target).map_err(|e| Error::io("rename", &target, e))?;
        }
        Ok(())
    }

    /// Total bytes per round.
    pub(crate) fn bytes(&self) -> usize {
        self.files.iter().map(|(_, c)| c.len()).sum()
    }

    /// Writes per round.
    pub(crate) fn count(&self) -> usize {
        self.files.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files_in(dir: &Path) -> Vec<(String, u64)> {
        let mut sizes: Vec<(String, u64)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    e.metadata().unwrap().len(),
                )
            })
            .collect();
        sizes.sort();
        sizes
    }

    #[test]
    fn floor_writes_leave_files_of_the_asked_sizes_and_no_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let floor = FloorWrites::new(&dir.path().join("f"), "floor", &[3, 5]).unwrap();
        floor.write_all().unwrap();
        floor.write_all().unwrap();
        let durable = files_in(&dir.path().join("f"));
        floor.write_plain().unwrap();
        assert_eq!(files_in(&dir.path().join("f")), durable);
        assert_eq!(
            durable,
            [
                ("floor-0.json".to_owned(), 3),
                ("floor-1.json".to_owned(), 5)
            ]
        );
        assert_eq!((floor.count(), floor.bytes()), (2, 8));
    }
}
