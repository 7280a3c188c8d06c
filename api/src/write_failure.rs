//! What a failed write to the API server means for kerf's components: one classification of
//! API errors shared by kerf-controller and the kubelet plugin, so both decide alike which
//! failures a user must be told about.
//!
//! Three kinds ([`FailureKind`]):
//! - *expected*: part of optimistic concurrency — a conflict (409: the object changed since it
//!   was read), NotFound (404: deleted meanwhile) or Gone (410: an expired resourceVersion).
//!   The retry that follows sees the new state; these are never warnings.
//! - *transient*: the server or the path to it is struggling — 429, 5xx, timeouts, transport
//!   errors. Worth retrying; only a failure that outlasts the retry budget is reported.
//! - *refused*: the server answered and will answer the same way again until something
//!   changes — 403 (RBAC), 422 (validation, among it `field is immutable`), 400, 413 and the
//!   other 4xx. Retrying cannot help; the user has to act, so the failure is reported at once.
//!
//! The codes and reasons are those of apimachinery's `StatusReason`s
//! (kubernetes/kubernetes `staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/types.go`) as
//! `NewGenericServerResponse` in `staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go`
//! maps HTTP codes to them.

/// The text of a validation error on a field that may not change after creation
/// (apimachinery's `field.ErrorTypeInvalid` with `apimachineryvalidation.FieldImmutableErrorMsg`
/// in `staging/src/k8s.io/apimachinery/pkg/api/validation/objectmeta.go`).
const FIELD_IMMUTABLE: &str = "field is immutable";

/// How a failed API write should be handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Optimistic concurrency at work: retry quietly.
    Expected,
    /// The server is struggling: retry, and report only when it outlasts the retries.
    Transient,
    /// The server said no and will say it again: report now, and back off.
    Refused,
}

/// Why an API write failed, one variant per class of answer. The variant names are the
/// `reason` label of the `kerf_api_write_failures_total` metric ([`WriteFailure::label`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteFailure {
    /// 409: the object changed since it was read (or already exists).
    Conflict,
    /// 404: the object was deleted meanwhile.
    NotFound,
    /// 410: the resourceVersion is too old.
    Gone,
    /// 429: the server (or API Priority and Fairness) throttles the client.
    TooManyRequests,
    /// 5xx: the server failed, timed out or is unavailable.
    ServerError,
    /// No answer: connection, TLS or timeout on the client's side.
    Transport,
    /// 401: the credentials are not accepted.
    Unauthorized,
    /// 403: RBAC (or an admission plugin) denies the verb on the resource.
    Forbidden,
    /// 422 on a field that may not change after creation (`field is immutable`).
    FieldImmutable,
    /// 422: the written object does not validate.
    Invalid,
    /// 400: the request itself is malformed.
    BadRequest,
    /// 413: the request or the object is too large.
    TooLarge,
    /// Any other 4xx (405, 406, 415, …).
    OtherRefusal,
}

impl WriteFailure {
    /// Classifies an HTTP status `code` with the Status `message` the server sent.
    fn from_status(code: u16, message: &str) -> Self {
        match code {
            409 => Self::Conflict,
            404 => Self::NotFound,
            410 => Self::Gone,
            429 => Self::TooManyRequests,
            401 => Self::Unauthorized,
            403 => Self::Forbidden,
            422 if message.contains(FIELD_IMMUTABLE) => Self::FieldImmutable,
            422 => Self::Invalid,
            400 => Self::BadRequest,
            413 => Self::TooLarge,
            402 | 405..=408 | 411 | 412 | 414..=421 | 423..=428 | 430..=499 => Self::OtherRefusal,
            // 5xx, and codes no API server sends: whatever it is, the server had trouble.
            _ => Self::ServerError,
        }
    }

    /// Classifies a kube client error: an API answer by its Status, anything else (no
    /// answer, an answer that did not decode) as [`WriteFailure::Transport`].
    pub fn of(error: &kube::Error) -> Self {
        match error {
            kube::Error::Api(status) => Self::from_status(status.code, &status.message),
            _ => Self::Transport,
        }
    }

    /// How to handle it.
    pub fn kind(self) -> FailureKind {
        match self {
            Self::Conflict | Self::NotFound | Self::Gone => FailureKind::Expected,
            Self::TooManyRequests | Self::ServerError | Self::Transport => FailureKind::Transient,
            Self::Unauthorized
            | Self::Forbidden
            | Self::FieldImmutable
            | Self::Invalid
            | Self::BadRequest
            | Self::TooLarge
            | Self::OtherRefusal => FailureKind::Refused,
        }
    }

    /// The variant's name: the metric's `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Conflict => "Conflict",
            Self::NotFound => "NotFound",
            Self::Gone => "Gone",
            Self::TooManyRequests => "TooManyRequests",
            Self::ServerError => "ServerError",
            Self::Transport => "Transport",
            Self::Unauthorized => "Unauthorized",
            Self::Forbidden => "Forbidden",
            Self::FieldImmutable => "FieldImmutable",
            Self::Invalid => "Invalid",
            Self::BadRequest => "BadRequest",
            Self::TooLarge => "TooLarge",
            Self::OtherRefusal => "OtherRefusal",
        }
    }
}

/// The server's own words about `error`: the Status message (with its code and reason) of an
/// API answer, else the client's error.
fn server_message(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) if status.reason.is_empty() => {
            format!("{} ({})", status.message, status.code)
        }
        kube::Error::Api(status) => {
            format!("{} ({} {})", status.message, status.code, status.reason)
        }
        other => other.to_string(),
    }
}

/// What the user can do about a refused write of `verb` on `resource` (plural, with the
/// subresource, e.g. `pods` or `resourceclaims/status`) by `component` (`kerf-controller`,
/// `kerf-kubelet-plugin`); `None` when the Status message says it all.
pub fn advice(
    failure: WriteFailure,
    verb: &str,
    resource: &str,
    component: &str,
) -> Option<String> {
    match failure {
        WriteFailure::Forbidden => Some(format!(
            "{component}'s ServiceAccount lacks `{verb}` on `{resource}`; check its ClusterRole \
             (deploy/helm/kerf/templates/*rbac*.yaml) against the cluster's"
        )),
        WriteFailure::FieldImmutable if resource.starts_with("resourceclaims") => Some(
            "the API server no longer accepts the claim's stored spec back (opaque parameters \
             stored with whitespace, written while kerf's admission webhook was away); \
             recreate the claim with compact JSON parameters, or `kubectl replace` it"
                .to_owned(),
        ),
        WriteFailure::Unauthorized => Some(format!(
            "the API server does not accept {component}'s credentials; check its token"
        )),
        WriteFailure::TooLarge => Some(format!(
            "the {resource} write is larger than the API server accepts"
        )),
        _ => None,
    }
}

/// Event reason of a write the API server refused.
pub const WRITE_REFUSED: &str = "WriteRefused";
/// Event reason of a write that keeps failing after its retries.
pub const WRITE_FAILING: &str = "WriteFailing";

/// One write of a component, named for its failure report: `verb` on `resource` (plural, with
/// the subresource, as RBAC names it) of `object` (`namespace/name`, or the name of a
/// cluster-scoped object).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteAttempt<'a> {
    /// The component that writes: `kerf-controller`, `kerf-kubelet-plugin`.
    pub component: &'a str,
    /// RBAC verb: `patch`, `create`, `update`, `delete`.
    pub verb: &'a str,
    /// Plural resource and subresource, e.g. `resourceclaims/status`.
    pub resource: &'a str,
    /// The object written.
    pub object: &'a str,
}

/// A failed write as the user is told about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// How the API server's answer was classified.
    pub failure: WriteFailure,
    /// The Event reason: [`WRITE_REFUSED`] or [`WRITE_FAILING`].
    pub reason: &'static str,
    /// The Event note: the write, the server's words and what to do.
    pub note: String,
}

/// What to tell the user about `error` from `write` at its `attempts`-th consecutive failure;
/// `None` when the failure is expected, or transient and within its `retry_budget` attempts.
/// The note holds no attempt count: a failure repeated on every retry reads the same, so an
/// event recorder can count the repeats in one Event's series.
pub fn assess(
    write: &WriteAttempt<'_>,
    error: &kube::Error,
    attempts: u32,
    retry_budget: u32,
) -> Option<Report> {
    let failure = WriteFailure::of(error);
    let WriteAttempt {
        component,
        verb,
        resource,
        object,
    } = *write;
    let said = server_message(error);
    let (reason, mut note) = match failure.kind() {
        FailureKind::Expected => return None,
        FailureKind::Transient if attempts < retry_budget => return None,
        FailureKind::Transient => (
            WRITE_FAILING,
            format!(
                "{component} keeps failing to {verb} {resource} {object}, retrying with back-off: {said}"
            ),
        ),
        FailureKind::Refused => (
            WRITE_REFUSED,
            format!("{component} could not {verb} {resource} {object}: {said}"),
        ),
    };
    if let Some(advice) = advice(failure, verb, resource, component) {
        note = format!("{note}. {advice}");
    }
    Some(Report {
        failure,
        reason,
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn conflicts_and_deletions_are_expected() {
        for code in [409, 404, 410] {
            assert_eq!(
                WriteFailure::of(&api(code, "x")).kind(),
                FailureKind::Expected
            );
        }
    }

    #[test]
    fn throttling_and_server_errors_are_transient() {
        for code in [429, 500, 503, 504] {
            assert_eq!(
                WriteFailure::of(&api(code, "x")).kind(),
                FailureKind::Transient,
                "{code}"
            );
        }
    }

    #[test]
    fn refusals_are_named_by_what_the_server_said() {
        let immutable = r#"ResourceClaim.resource.k8s.io "c" is invalid: spec: Invalid value: "...": field is immutable"#;
        let cases = [
            (403, "forbidden", WriteFailure::Forbidden),
            (422, immutable, WriteFailure::FieldImmutable),
            (422, "spec.x: Invalid value", WriteFailure::Invalid),
            (400, "bad", WriteFailure::BadRequest),
            (413, "too large", WriteFailure::TooLarge),
            (415, "media type", WriteFailure::OtherRefusal),
        ];
        for (code, message, expected) in cases {
            let failure = WriteFailure::of(&api(code, message));
            assert_eq!(failure, expected);
            assert_eq!(failure.kind(), FailureKind::Refused);
        }
        assert_eq!(WriteFailure::FieldImmutable.label(), "FieldImmutable");
    }

    #[test]
    fn advice_names_the_right_and_the_way_out() {
        let forbidden =
            advice(WriteFailure::Forbidden, "patch", "pods", "kerf-controller").unwrap();
        assert!(
            forbidden.contains("kerf-controller's ServiceAccount lacks `patch` on `pods`"),
            "{forbidden}"
        );
        assert!(forbidden.contains("deploy/"), "{forbidden}");
        let immutable =
            advice(WriteFailure::FieldImmutable, "patch", "resourceclaims", "a").unwrap();
        assert!(immutable.contains("compact JSON"), "{immutable}");
        assert!(immutable.contains("kubectl replace"), "{immutable}");
        assert_eq!(advice(WriteFailure::Invalid, "patch", "pods", "a"), None);
    }

    #[test]
    fn the_server_message_keeps_code_and_reason() {
        let error = kube::Error::Api(
            kube::core::Status::failure("pods \"p\" is forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        );
        assert_eq!(
            server_message(&error),
            "pods \"p\" is forbidden (403 Forbidden)"
        );
    }
}
