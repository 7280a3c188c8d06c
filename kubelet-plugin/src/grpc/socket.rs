//! Unix socket listeners that replace stale sockets on start and remove theirs on drop.
//!
//! "Theirs" is checked: during a rolling update without per-instance socket names (no pod
//! UID), the new instance replaces the old one's socket file at the same path, and the old
//! instance's shutdown must then not remove the new instance's socket. The pluginwatcher's
//! rule (kubernetes `pkg/kubelet/pluginmanager/pluginwatcher/README.md`): "A plugin should NOT
//! remove any sockets belonging to other plugins".

use std::path::{Path, PathBuf};

use std::sync::Arc;

use kerf_h2_authority::{AuthorityLog, LenientAuthority};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt as _};

use crate::{Error, Result};

/// The longest path `sockaddr_un` holds, including the terminating NUL.
const SUN_PATH_MAX: usize = 108;

/// A bound Unix socket whose file is removed when this value is dropped.
pub(crate) struct BoundSocket {
    path: PathBuf,
    listener: Option<UnixListener>,
    /// Device and inode of the file this value bound, to leave a successor's file alone.
    identity: Option<(u64, u64)>,
}

impl BoundSocket {
    /// Binds `path`, creating its directory and replacing a stale socket file left by an
    /// earlier run. Anything at `path` that is not a socket is left alone and reported.
    ///
    /// # Errors
    /// The path is too long for a Unix socket, is occupied by a non-socket file, or cannot
    /// be bound.
    pub fn bind(path: &Path) -> Result<Self> {
        if path.as_os_str().len() >= SUN_PATH_MAX {
            return Err(Error::Config(format!(
                "socket path {} is {} bytes long; Unix sockets allow at most {}",
                path.display(),
                path.as_os_str().len(),
                SUN_PATH_MAX - 1
            )));
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        remove_stale(path)?;
        let listener = UnixListener::bind(path).map_err(|e| Error::io("bind", path, e))?;
        Ok(BoundSocket {
            path: path.to_owned(),
            listener: Some(listener),
            identity: file_identity(path),
        })
    }

    /// The incoming connections, for tonic's `serve_with_incoming*`, each behind a
    /// [`LenientAuthority`] so that requests are answered whatever `:authority` the client
    /// sends (the kubelet's plugin watcher sends the socket path, which h2 alone refuses).
    /// `name` names the socket in the log line that reports each new authority form. The
    /// socket file stays until this value is dropped.
    ///
    /// # Errors
    /// The stream was already taken.
    pub(crate) fn incoming_any_authority(
        &mut self,
        name: &str,
    ) -> Result<impl Stream<Item = std::io::Result<LenientAuthority<UnixStream>>> + use<>> {
        let listener = self.listener.take().ok_or_else(|| {
            Error::Config(format!("socket {} already serving", self.path.display()))
        })?;
        let log = AuthorityLog::new(name);
        Ok(UnixListenerStream::new(listener).map(move |accepted| {
            accepted.map(|stream| LenientAuthority::new(stream, Arc::clone(&log)))
        }))
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        let current = file_identity(&self.path);
        if current.is_some() && current != self.identity {
            tracing::info!(path = %self.path.display(), "socket replaced by another instance; leaving it");
            return;
        }
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove socket");
        }
    }
}

/// Device and inode of the file at `path`, `None` when there is none.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino()))
}

fn remove_stale(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            tracing::info!(path = %path.display(), "replacing stale socket");
            std::fs::remove_file(path).map_err(|e| Error::io("remove stale socket", path, e))
        }
        Ok(_) => Err(Error::Config(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("stat", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn replaces_stale_socket_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let first = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(first); // leaves the file behind, like a crashed plugin
        assert!(path.exists());
        let bound = BoundSocket::bind(&path).unwrap();
        assert!(path.exists());
        drop(bound);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn leaves_a_successors_socket_at_the_same_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let old = BoundSocket::bind(&path).unwrap();
        let new = BoundSocket::bind(&path).unwrap();
        drop(old);
        assert!(
            path.exists(),
            "the old instance removed the new one's socket"
        );
        drop(new);
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn refuses_to_replace_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        std::fs::write(&path, b"data").unwrap();
        let err = BoundSocket::bind(&path).err().unwrap();
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }

    #[test]
    fn rejects_too_long_paths() {
        let long = PathBuf::from(format!("/tmp/{}.sock", "a".repeat(120)));
        let err = BoundSocket::bind(&long).err().unwrap();
        assert!(err.to_string().contains("at most 107"), "{err}");
    }
}
