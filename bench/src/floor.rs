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
pub fn durable_write(dir: &Path, name: &str, contents: &[u8]) -> Result<()> {
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
pub struct FloorWrites {
    dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
}

impl FloorWrites {
    /// Floor writes of the given sizes into `dir` (created if missing), as files named
    /// `<prefix>-<n>.json`.
    ///
    /// # Errors
    /// `dir` cannot be created.
    pub fn new(dir: &Path, prefix: &str, sizes: &[usize]) -> Result<Self> {
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
    pub fn write_all(&self) -> Result<()> {
        for (name, contents) in &self.files {
            durable_write(&self.dir, name, contents)?;
        }
        Ok(())
    }

    /// Writes the files of all `sets` the way a group commit must at least: every temporary
    /// file written, one `syncfs` for all their data, the renames, one fsync per directory.
    /// With std and rustix alone, like [`durable_write`].
    ///
    /// # Errors
    /// A step fails.
    pub fn write_grouped(sets: &[FloorWrites]) -> Result<()> {
        let mut staged = Vec::new();
        for set in sets {
            for (name, contents) in &set.files {
                let temp = set.dir.join(format!(".{name}.floor-tmp"));
                let mut file = File::create(&temp).map_err(|e| Error::io("create", &temp, e))?;
                file.write_all(contents)
                    .map_err(|e| Error::io("write", &temp, e))?;
                staged.push((file, temp, set.dir.join(name)));
            }
        }
        if let Some((file, temp, _)) = staged.first() {
            rustix::fs::syncfs(file)
                .map_err(|e| Error::io("syncfs", temp, std::io::Error::from(e)))?;
        }
        let mut dirs: Vec<&Path> = Vec::new();
        for (_, temp, target) in &staged {
            std::fs::rename(temp, target).map_err(|e| Error::io("rename", target, e))?;
        }
        for set in sets {
            if !dirs.contains(&set.dir.as_path()) {
                dirs.push(&set.dir);
            }
        }
        for dir in dirs {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io("fsync dir", dir, e))?;
        }
        Ok(())
    }

    /// Total bytes per round.
    pub fn bytes(&self) -> usize {
        self.files.iter().map(|(_, c)| c.len()).sum()
    }

    /// Writes per round.
    pub fn count(&self) -> usize {
        self.files.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_writes_leave_files_of_the_asked_sizes_and_no_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let floor = FloorWrites::new(&dir.path().join("f"), "floor", &[3, 5]).unwrap();
        floor.write_all().unwrap();
        floor.write_all().unwrap();
        let mut sizes: Vec<(String, u64)> = std::fs::read_dir(dir.path().join("f"))
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
        assert_eq!(
            sizes,
            [
                ("floor-0.json".to_owned(), 3),
                ("floor-1.json".to_owned(), 5)
            ]
        );
        assert_eq!((floor.count(), floor.bytes()), (2, 8));
    }
}
