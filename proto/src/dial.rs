//! Dialling a plugin's Unix socket with the `:authority` a given client sends.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use kerf_h2_authority::{SendAuthority, WithAuthority};
use tokio::net::UnixStream;
use tokio_util::either::Either;
use tonic::transport::{Channel, Endpoint, Uri};

/// The `:authority` a caller of a plugin socket sends, by the client it imitates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authority {
    /// `localhost`: grpc-go dialling `unix:<path>`, as the kubelet's DRA client does
    /// (`k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin`, which dials `unix:` + the endpoint).
    Localhost,
    /// The socket's own path: grpc-go dialling the bare path with a context dialer and no
    /// `WithAuthority`, as the kubelet's plugin watcher does for registration sockets
    /// (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, `dial`).
    SocketPath,
    /// The socket's path percent-encoded as grpc C-core, so Python grpcio 1.57 and later,
    /// sends it when dialling `unix:<path>` without `grpc.default_authority`: grpcio 1.85.1
    /// drops the leading slash (`var%2Flib%2F...`), as captured on the wire.
    PercentEncodedPath,
    /// An empty value: grpc-go before 1.31 dialling a bare path (grpc/grpc-go#2628).
    Empty,
    /// No `:authority` at all (RFC 9113 §8.3.1 allows it).
    Absent,
    /// Any other value, byte for byte.
    Custom(Vec<u8>),
}

impl Authority {
    /// Every form kerf's sockets must answer, for tests that try them all.
    pub fn all_forms() -> [Authority; 5] {
        [
            Authority::Localhost,
            Authority::SocketPath,
            Authority::PercentEncodedPath,
            Authority::Empty,
            Authority::Absent,
        ]
    }

    /// What is sent when dialling the socket at `path`; `None` for `localhost`, which the
    /// HTTP/2 client sends by itself.
    fn to_send(&self, path: &Path) -> Option<SendAuthority> {
        let path = path.as_os_str().as_encoded_bytes();
        match self {
            Authority::Localhost => None,
            Authority::SocketPath => Some(SendAuthority::Value(path.to_vec())),
            Authority::PercentEncodedPath => Some(SendAuthority::Value(percent_encode(
                path.strip_prefix(b"/").unwrap_or(path),
            ))),
            Authority::Empty => Some(SendAuthority::Value(Vec::new())),
            Authority::Absent => Some(SendAuthority::Absent),
            Authority::Custom(value) => Some(SendAuthority::Value(value.clone())),
        }
    }
}

/// Percent-encodes what grpc C-core's URI encoding escapes in a `unix:` target's path: every
/// byte but unreserved characters (RFC 3986 §2.3).
fn percent_encode(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len() * 3);
    for &b in path {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    out
}

/// Connects a gRPC channel to the Unix socket at `path`, sending `authority` on every call.
///
/// # Errors
/// The socket does not accept the connection.
pub(crate) async fn dial_unix(
    path: &Path,
    authority: Authority,
) -> Result<Channel, tonic::transport::Error> {
    let socket: PathBuf = path.to_owned();
    let send = authority.to_send(path);
    // The URI gives h2 its own `:authority` (`localhost`); it is never resolved: the
    // connector ignores it.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            let send = send.clone();
            async move {
                let stream = UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(match send {
                    None => Either::Left(stream),
                    Some(send) => Either::Right(WithAuthority::new(stream, send)),
                }))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding_matches_grpcio_on_the_wire() {
        // Captured from grpcio 1.85.1 dialling `unix:/tmp/kerf-capture/s/cap-unset.sock`.
        assert_eq!(
            Authority::PercentEncodedPath.to_send(Path::new("/tmp/kerf-capture/s/cap-unset.sock")),
            Some(SendAuthority::Value(
                b"tmp%2Fkerf-capture%2Fs%2Fcap-unset.sock".to_vec()
            ))
        );
        assert_eq!(percent_encode(b"/a b"), b"%2Fa%20b".to_vec());
    }
}
