//! What clients put in `:authority`, what h2 accepts, and the server's and client's policies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::rewrite::{AuthorityPolicy, Decision};

/// The value the server side puts in place of an `:authority` h2 would refuse: the one
/// grpc-go sends for `unix:` targets (grpc-go `internal/transport`, since grpc/grpc-go#3730)
/// and the kubelet sets for its DRA and device plugin clients (kubernetes/kubernetes#112597).
pub(crate) const REPLACEMENT: &str = "localhost";

/// Whether h2's server accepts `value` as `:authority`: it parses it with
/// `http::uri::Authority` (h2 `server::Peer::convert_poll_message`) and resets the stream
/// with PROTOCOL_ERROR when that fails.
pub(crate) fn h2_accepts(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// The forms of `:authority` seen from gRPC clients on Unix sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthorityForm {
    /// No `:authority` (allowed by RFC 9113 §8.3.1; h2 accepts it).
    Absent,
    /// An empty value (grpc-go before 1.31 with a bare path target).
    Empty,
    /// A host name or address that h2 accepts, e.g. `localhost` (grpc-go for `unix:` targets).
    Host,
    /// A file system path, e.g. the socket's (grpc-go dialled with a bare path and no
    /// `WithAuthority`, as the kubelet's plugin watcher does).
    SocketPath,
    /// A path with percent-encoded slashes: grpc C-core, so Python grpcio, since 1.57 for
    /// `unix:` targets without `grpc.default_authority`. grpcio 1.85.1 sends the path
    /// without its leading slash (`run%2Fkerf%2Fx.sock` for `unix:/run/kerf/x.sock`);
    /// reports of earlier releases show `%2Frun%2Fkerf%2Fx.sock`. Both are this form.
    PercentEncodedPath,
    /// Anything else h2 refuses.
    Other,
}

impl AuthorityForm {
    /// The form of an `:authority` value, `None` for none.
    pub fn of(value: Option<&[u8]>) -> Self {
        match value {
            None => AuthorityForm::Absent,
            Some([]) => AuthorityForm::Empty,
            Some(v) if h2_accepts(v) => AuthorityForm::Host,
            Some([b'/', ..]) => AuthorityForm::SocketPath,
            Some(v) if contains_percent_slash(v) => AuthorityForm::PercentEncodedPath,
            Some(_) => AuthorityForm::Other,
        }
    }

    /// Words for logs.
    pub fn describe(self) -> &'static str {
        match self {
            AuthorityForm::Absent => "absent",
            AuthorityForm::Empty => "empty",
            AuthorityForm::Host => "host name",
            AuthorityForm::SocketPath => "socket path",
            AuthorityForm::PercentEncodedPath => "percent-encoded path",
            AuthorityForm::Other => "not a valid authority",
        }
    }

    /// Whether the server side passes this form on unchanged.
    fn is_accepted_as_is(self) -> bool {
        matches!(self, AuthorityForm::Absent | AuthorityForm::Host)
    }

    fn bit(self) -> u8 {
        match self {
            AuthorityForm::Absent => 1,
            AuthorityForm::Empty => 1 << 1,
            AuthorityForm::Host => 1 << 2,
            AuthorityForm::SocketPath => 1 << 3,
            AuthorityForm::PercentEncodedPath => 1 << 4,
            AuthorityForm::Other => 1 << 5,
        }
    }
}

/// Whether `value` holds a percent-encoded slash (`%2F` or `%2f`).
fn contains_percent_slash(value: &[u8]) -> bool {
    value.windows(3).any(|w| w.eq_ignore_ascii_case(b"%2f"))
}

/// The longest `:authority` value quoted in a log line.
const QUOTED_MAX: usize = 256;

/// Remembers which authority forms one socket has seen, so that each is logged once, at
/// info, the first time a request uses it: an admin on an unusual kubelet sees what it
/// sends, and nothing is logged per request. Shared by all connections of one socket.
#[derive(Debug)]
pub struct AuthorityLog {
    socket: String,
    seen: AtomicU8,
}

impl AuthorityLog {
    /// A log for the socket named `socket` in log lines (e.g. `registration`).
    pub fn new(socket: impl Into<String>) -> Arc<Self> {
        Arc::new(AuthorityLog {
            socket: socket.into(),
            seen: AtomicU8::new(0),
        })
    }

    /// Records one request's form; logs it if it is the first of its form.
    pub fn observe(&self, form: AuthorityForm, value: Option<&[u8]>) {
        let bit = form.bit();
        if self.seen.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
            return;
        }
        let quoted =
            value.map(|v| String::from_utf8_lossy(&v[..v.len().min(QUOTED_MAX)]).into_owned());
        let action = if form.is_accepted_as_is() {
            "passed on"
        } else {
            "replaced with localhost"
        };
        tracing::info!(
            socket = %self.socket,
            form = form.describe(),
            authority = quoted.as_deref().unwrap_or(""),
            action,
            "first gRPC request with this :authority form"
        );
    }

    /// Whether a request of `form` has been seen.
    pub fn has_seen(&self, form: AuthorityForm) -> bool {
        self.seen.load(Ordering::Relaxed) & form.bit() != 0
    }
}

/// The server side's policy: an `:authority` h2 accepts (or none) passes, any other is
/// replaced with [`REPLACEMENT`].
pub(crate) struct Lenient {
    pub log: Arc<AuthorityLog>,
}

impl AuthorityPolicy for Lenient {
    fn decide(&mut self, authority: Option<&[u8]>) -> Decision {
        let form = AuthorityForm::of(authority);
        self.log.observe(form, authority);
        if form.is_accepted_as_is() {
            Decision::Keep
        } else {
            Decision::Set(REPLACEMENT.as_bytes().to_vec())
        }
    }
}

/// The `:authority` a client sends, whatever its HTTP/2 stack would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendAuthority {
    /// This value, byte for byte, valid or not.
    Value(Vec<u8>),
    /// No `:authority` at all.
    Absent,
}

impl AuthorityPolicy for SendAuthority {
    fn decide(&mut self, _: Option<&[u8]>) -> Decision {
        match self {
            SendAuthority::Value(v) => Decision::Set(v.clone()),
            SendAuthority::Absent => Decision::Remove,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_are_told_apart() {
        let cases: [(Option<&[u8]>, AuthorityForm); 8] = [
            (None, AuthorityForm::Absent),
            (Some(b""), AuthorityForm::Empty),
            (Some(b"localhost"), AuthorityForm::Host),
            (Some(b"127.0.0.1:80"), AuthorityForm::Host),
            (
                Some(b"/var/lib/kubelet/plugins_registry/gpu.kerf.dev-reg.sock"),
                AuthorityForm::SocketPath,
            ),
            (
                Some(b"%2Fvar%2Flib%2Fkubelet%2Fplugins%2Fdra.sock"),
                AuthorityForm::PercentEncodedPath,
            ),
            (
                Some(b"var%2Flib%2Fkubelet%2Fplugins%2Fdra.sock"),
                AuthorityForm::PercentEncodedPath,
            ),
            (Some(b"a b"), AuthorityForm::Other),
        ];
        for (value, form) in cases {
            assert_eq!(AuthorityForm::of(value), form, "{value:?}");
        }
    }

    #[test]
    fn h2_refuses_what_the_issue_reports() {
        assert!(!h2_accepts(
            b"/var/lib/kubelet/plugins_registry/gpu.kerf.dev-reg.sock"
        ));
        assert!(!h2_accepts(b"%2Fvar%2Flib%2Fkubelet%2Fplugins%2Fdra.sock"));
        assert!(!h2_accepts(b""));
        assert!(h2_accepts(b"localhost"));
    }

    #[test]
    fn each_form_is_logged_once() {
        let log = AuthorityLog::new("test");
        assert!(!log.has_seen(AuthorityForm::SocketPath));
        let mut policy = Lenient {
            log: Arc::clone(&log),
        };
        assert_eq!(
            policy.decide(Some(b"/x.sock")),
            Decision::Set(b"localhost".to_vec())
        );
        assert_eq!(policy.decide(Some(b"localhost")), Decision::Keep);
        assert_eq!(policy.decide(None), Decision::Keep);
        assert!(log.has_seen(AuthorityForm::SocketPath));
        assert!(log.has_seen(AuthorityForm::Host));
        assert!(log.has_seen(AuthorityForm::Absent));
        assert!(!log.has_seen(AuthorityForm::Empty));
    }
}
