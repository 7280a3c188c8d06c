//! The floor of a prepare: the writes any prepare must make, done with nothing else — the
//! checkpoint entry, replaced atomically (the plugin's checkpoint outlives the plugin, not the
//! node, so it is not fsync'd).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The files one prepare writes, by size: the floor writes as many of the same sizes.
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

    /// Writes every file as the plugin writes its checkpoint and a CDI spec: a temporary file
    /// renamed over the target, without fsync.
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
        floor.write_plain().unwrap();
        floor.write_plain().unwrap();
        let written = files_in(&dir.path().join("f"));
        assert_eq!(
            written,
            [
                ("floor-0.json".to_owned(), 3),
                ("floor-1.json".to_owned(), 5)
            ]
        );
        assert_eq!((floor.count(), floor.bytes()), (2, 8));
    }
}
