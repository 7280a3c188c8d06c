//! Graceful deletion of pods, as kube-apiserver does it for pods bound to a node whose
//! kubelet runs ([`FakeApi::graceful_pod_deletion_on`]).
//!
//! Upstream (kubernetes/kubernetes):
//! - `pkg/registry/core/pod/strategy.go`, `podStrategy.CheckGracefulDelete`: the grace period
//!   is the request's `gracePeriodSeconds`, else `spec.terminationGracePeriodSeconds`; 0 for a
//!   pod not bound to a node (`spec.nodeName` empty) or already terminal (phase `Failed` or
//!   `Succeeded`); a negative one is 1;
//! - `staging/src/k8s.io/apiserver/pkg/registry/rest/delete.go`, `BeforeDelete`: a first
//!   graceful delete sets `deletionTimestamp` to now + grace and `deletionGracePeriodSeconds`
//!   to the grace, and bumps `generation`; a later delete may only shorten the grace
//!   (the timestamp moves by the difference), a longer or equal one leaves the pod as it is,
//!   and a pod whose stored grace is 0 is deleted at once;
//! - `staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go`,
//!   `updateForGracefulDeletionAndFinalizers`: a grace of 0 deletes the object at once (unless
//!   finalizers remain), any other leaves it in place for the kubelet, whose status manager
//!   deletes it with grace 0 once its containers are gone (`pkg/kubelet/status/
//!   status_manager.go`, `syncPod`); `shouldDeleteDuringUpdate`: an update deletes an object
//!   marked for deletion only when no finalizer remains and its grace is 0 (see
//!   `State::commit`).
//!
//! Where FakeApi differs: `spec.terminationGracePeriodSeconds` is not defaulted on create, so
//! a pod without one gets the default (30 s) here; pods bound to nodes with no kubelet
//! registered (most tests have none) are deleted at once, as if their kubelet had confirmed
//! the deletion at once; and a grace shortened to 0 deletes without the `MODIFIED` event
//! kube-apiserver's intermediate update sends first.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::store::{metadata_mut, str_at};
use super::{Broadcast, FakeApi, ObjKey, State};

/// `spec.terminationGracePeriodSeconds` as API defaulting sets it
/// (`pkg/apis/core/v1/defaults.go`, `SetDefaults_PodSpec`: `DefaultTerminationGracePeriodSeconds`).
const DEFAULT_TERMINATION_GRACE_SECONDS: i64 = 30;

/// What a DELETE does to a pod ([`before_delete`]).
#[derive(Debug, PartialEq, Eq)]
enum Grace {
    /// Delete now (a grace of 0, or a pod whose stored grace is 0).
    Immediate,
    /// Already being deleted with a grace no longer than the one asked for: nothing changes.
    Pending,
    /// Mark (or re-mark) the pod: `deletionTimestamp` at `deadline`, the grace in seconds.
    Mark { seconds: i64, deadline: Timestamp },
}

impl FakeApi {
    /// Makes DELETE of pods bound to `node` graceful, as kube-apiserver always makes it: such a
    /// pod gets `deletionTimestamp` and `deletionGracePeriodSeconds` and stays until its
    /// kubelet deletes it with grace 0 (`kerf_tests::pod_runner::PodRunner` does).
    ///
    /// Without this, FakeApi deletes bound pods at once, as if a kubelet had confirmed at once:
    /// most tests run no kubelet, and their pods would otherwise never go.
    pub fn graceful_pod_deletion_on(&self, node: &str) {
        self.state().kubelet_nodes.insert(node.to_owned());
    }
}

impl State {
    /// Deletes `current` as DELETE with `options` (a `DeleteOptions` body, or null) does:
    /// pods on a node with a kubelet gracefully, everything else at once (with finalizers).
    pub(super) fn delete_with_options(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        current: Value,
        options: &Value,
    ) -> Value {
        let graceful = key.prefix == "api/v1"
            && key.resource == "pods"
            && self
                .kubelet_nodes
                .contains(str_at(&current, "/spec/nodeName"));
        if !graceful {
            return self.delete_object(events, key, current);
        }
        match before_delete(&current, options, Timestamp::now()) {
            Grace::Immediate => self.delete_object(events, key, current),
            Grace::Pending => current,
            Grace::Mark { seconds, deadline } => {
                let mut marked = current.clone();
                let first = !is_deleting(&current);
                let meta = metadata_mut(&mut marked);
                meta.insert("deletionTimestamp".to_owned(), timestamp(deadline));
                meta.insert("deletionGracePeriodSeconds".to_owned(), json!(seconds));
                if first
                    && let Some(generation) = meta.get("generation").and_then(Value::as_i64)
                    && generation > 0
                {
                    meta.insert("generation".to_owned(), json!(generation + 1));
                }
                // `commit` deletes a marked object with grace 0 and no finalizers left.
                self.commit(events, key, marked, Some(current))
            }
        }
    }
}

/// `deadline` as the API serializes a `metav1.Time` (RFC 3339, whole seconds).
fn timestamp(deadline: Timestamp) -> Value {
    serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        deadline,
    ))
    .unwrap_or(Value::Null)
}

fn is_deleting(pod: &Value) -> bool {
    pod.pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
}

/// `BeforeDelete` with `podStrategy.CheckGracefulDelete`, at time `now`.
fn before_delete(pod: &Value, options: &Value, now: Timestamp) -> Grace {
    let asked = options
        .get("gracePeriodSeconds")
        .and_then(Value::as_i64)
        .map(|seconds| if seconds < 0 { 1 } else { seconds });
    if is_deleting(pod) {
        let stored = pod
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if stored <= 0 {
            return Grace::Immediate;
        }
        return match asked {
            Some(seconds) if seconds < stored => {
                let marked = str_at(pod, "/metadata/deletionTimestamp")
                    .parse::<Timestamp>()
                    .unwrap_or(now);
                let deadline = marked
                    .checked_sub(SignedDuration::from_secs(stored - seconds))
                    .unwrap_or(now);
                Grace::Mark { seconds, deadline }
            }
            _ => Grace::Pending,
        };
    }
    let mut seconds = asked.unwrap_or_else(|| {
        pod.pointer("/spec/terminationGracePeriodSeconds")
            .and_then(Value::as_i64)
            .unwrap_or(DEFAULT_TERMINATION_GRACE_SECONDS)
    });
    let phase = str_at(pod, "/status/phase");
    if str_at(pod, "/spec/nodeName").is_empty() || matches!(phase, "Failed" | "Succeeded") {
        seconds = 0;
    }
    if seconds < 0 {
        seconds = 1;
    }
    if seconds == 0 {
        return Grace::Immediate;
    }
    let deadline = now
        .checked_add(SignedDuration::from_secs(seconds))
        .unwrap_or(now);
    Grace::Mark { seconds, deadline }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().unwrap()
    }

    #[test]
    fn a_bound_pod_gets_the_grace_asked_for_else_its_own_else_30() {
        let now = at("2026-01-01T00:00:00Z");
        let pod = json!({"spec": {"nodeName": "n"}});
        assert_eq!(
            before_delete(&pod, &json!({"gracePeriodSeconds": 5}), now),
            Grace::Mark {
                seconds: 5,
                deadline: at("2026-01-01T00:00:05Z")
            }
        );
        let own = json!({"spec": {"nodeName": "n", "terminationGracePeriodSeconds": 7}});
        assert!(matches!(
            before_delete(&own, &Value::Null, now),
            Grace::Mark { seconds: 7, .. }
        ));
        assert!(matches!(
            before_delete(&pod, &json!({}), now),
            Grace::Mark { seconds: 30, .. }
        ));
        assert!(matches!(
            before_delete(&pod, &json!({"gracePeriodSeconds": -3}), now),
            Grace::Mark { seconds: 1, .. }
        ));
        assert_eq!(
            before_delete(&pod, &json!({"gracePeriodSeconds": 0}), now),
            Grace::Immediate
        );
    }

    #[test]
    fn unbound_and_terminal_pods_go_at_once() {
        let now = Timestamp::now();
        let unbound = json!({"spec": {"terminationGracePeriodSeconds": 7}});
        assert_eq!(before_delete(&unbound, &json!({}), now), Grace::Immediate);
        let done = json!({"spec": {"nodeName": "n"}, "status": {"phase": "Succeeded"}});
        assert_eq!(before_delete(&done, &json!({}), now), Grace::Immediate);
    }

    #[test]
    fn a_pod_being_deleted_only_gets_a_shorter_grace() {
        let now = at("2026-01-01T00:00:10Z");
        let marked = json!({
            "metadata": {"deletionTimestamp": "2026-01-01T00:00:30Z", "deletionGracePeriodSeconds": 30},
            "spec": {"nodeName": "n"},
        });
        assert_eq!(
            before_delete(&marked, &json!({"gracePeriodSeconds": 30}), now),
            Grace::Pending
        );
        assert_eq!(before_delete(&marked, &json!({}), now), Grace::Pending);
        assert_eq!(
            before_delete(&marked, &json!({"gracePeriodSeconds": 0}), now),
            Grace::Mark {
                seconds: 0,
                deadline: at("2026-01-01T00:00:00Z")
            }
        );
        let zero = json!({
            "metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 0},
            "spec": {"nodeName": "n"},
        });
        assert_eq!(before_delete(&zero, &json!({}), now), Grace::Immediate);
    }
}
