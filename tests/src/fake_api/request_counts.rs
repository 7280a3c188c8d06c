//! API requests tallied by who sent them and what they asked: verb, resource and subresource,
//! as kube-apiserver's `apiserver_request_total` metric labels them (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/endpoints/metrics/metrics.go`, `requestCounter`: verb,
//! group, version, resource, subresource, scope, component, code) plus the user, which the
//! audit log adds. Read from [`FakeApi::requests`], the log every request enters before
//! authorization or any injected fault, so refused and failed requests count too, as they
//! cost the API server a round trip all the same.
//!
//! Benchmarks use it to say what one pod costs the API server per path
//! (`kerf-bench scheduling`): on a real control plane every write is a round of
//! kube-apiserver admission, an etcd transaction and a watch fan-out.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{Attributes, FakeApi, RecordedRequest};

/// What one tally counts: who, which verb, which resource (`group/resource[/subresource]`,
/// the core group written without a group).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestKind {
    /// [`RecordedRequest::user`].
    pub user: String,
    /// The Kubernetes verb (`create`, `patch`, `update`, `get`, `list`, `watch`, `delete`).
    pub verb: String,
    /// `resource` or `resource/subresource`, prefixed with `group/` outside the core group,
    /// e.g. `pods`, `resource.k8s.io/resourceclaims/status`, `events.k8s.io/events`.
    pub resource: String,
}

impl RequestKind {
    /// Whether the verb changes stored state (everything but `get`, `list` and `watch`).
    pub fn is_write(&self) -> bool {
        !matches!(self.verb.as_str(), "get" | "list" | "watch")
    }
}

/// Requests counted per [`RequestKind`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// The count of each kind seen.
    pub counts: BTreeMap<RequestKind, u64>,
}

impl RequestCounts {
    /// Tallies `requests`.
    pub fn of(requests: &[RecordedRequest]) -> Self {
        let mut counts = BTreeMap::new();
        for request in requests {
            let attributes =
                Attributes::from_request(&request.method, &request.path, &request.query);
            let mut resource = String::new();
            if !attributes.api_group.is_empty() {
                let _ = write!(resource, "{}/", attributes.api_group);
            }
            resource.push_str(if attributes.resource_request {
                &attributes.resource
            } else {
                &attributes.path
            });
            if !attributes.subresource.is_empty() {
                let _ = write!(resource, "/{}", attributes.subresource);
            }
            let kind = RequestKind {
                user: request.user.clone(),
                verb: attributes.verb,
                resource,
            };
            *counts.entry(kind).or_insert(0) += 1;
        }
        Self { counts }
    }

    /// The count of requests of `user` with `verb` on `resource` (as [`RequestKind`] writes
    /// it); 0 when none.
    pub fn get(&self, user: &str, verb: &str, resource: &str) -> u64 {
        self.counts
            .iter()
            .filter(|(k, _)| k.user == user && k.verb == verb && k.resource == resource)
            .map(|(_, n)| *n)
            .sum()
    }

    /// All writes (see [`RequestKind::is_write`]), of everyone.
    pub fn writes(&self) -> u64 {
        self.counts
            .iter()
            .filter(|(k, _)| k.is_write())
            .map(|(_, n)| *n)
            .sum()
    }

    /// The writes of `user`.
    pub fn writes_of(&self, user: &str) -> u64 {
        self.counts
            .iter()
            .filter(|(k, _)| k.is_write() && k.user == user)
            .map(|(_, n)| *n)
            .sum()
    }

    /// One line per kind, `user verb resource: count / per` (e.g. per pod), writes first and
    /// then reads, each sorted by user, verb and resource; `short` maps a user name to the
    /// name printed.
    pub fn describe_per(&self, per: u64, short: impl Fn(&str) -> String) -> Vec<String> {
        let per = per.max(1);
        let mut lines: Vec<(bool, String)> = self
            .counts
            .iter()
            .map(|(k, n)| {
                #[allow(
                    clippy::cast_precision_loss,
                    reason = "request counts of a benchmark are far below 2^52"
                )]
                let ratio = *n as f64 / per as f64;
                (
                    !k.is_write(),
                    format!("{} {} {}: {ratio:.2}", short(&k.user), k.verb, k.resource),
                )
            })
            .collect();
        lines.sort();
        lines.into_iter().map(|(_, line)| line).collect()
    }
}

impl FakeApi {
    /// Every request logged so far, tallied ([`RequestCounts::of`] of [`FakeApi::requests`]).
    pub fn request_counts(&self) -> RequestCounts {
        RequestCounts::of(&self.state().requests)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_api::Identity;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::Api;
    use kube::api::{Patch, PatchParams, PostParams};

    #[tokio::test]
    async fn counts_each_user_verb_and_subresource() {
        let fake = FakeApi::new();
        let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
        let cm: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a"}, "data": {"k": "v"}}))
        .unwrap();
        api.create(&PostParams::default(), &cm).await.unwrap();
        api.get("a").await.unwrap();
        api.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"k": "w"}})),
        )
        .await
        .unwrap();
        let admin = Identity::admin().username;
        let counts = fake.request_counts();
        assert_eq!(counts.get(&admin, "create", "configmaps"), 1);
        assert_eq!(counts.get(&admin, "patch", "configmaps"), 1);
        assert_eq!(counts.get(&admin, "get", "configmaps"), 1);
        assert_eq!(counts.writes(), 2);
        assert_eq!(counts.writes_of("someone else"), 0);
        let lines = counts.describe_per(2, str::to_owned);
        assert_eq!(lines[0], format!("{admin} create configmaps: 0.50"));
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn subresources_and_groups_are_named() {
        let request = |method: &str, path: &str| RecordedRequest {
            method: method.to_owned(),
            verb: "",
            path: path.to_owned(),
            query: String::new(),
            content_type: None,
            user: "u".to_owned(),
            at: tokio::time::Instant::now(),
        };
        let counts = RequestCounts::of(&[
            request(
                "PATCH",
                "/apis/resource.k8s.io/v1/namespaces/d/resourceclaims/c/status",
            ),
            request("POST", "/apis/events.k8s.io/v1/namespaces/d/events"),
        ]);
        assert_eq!(
            counts.get("u", "patch", "resource.k8s.io/resourceclaims/status"),
            1
        );
        assert_eq!(counts.get("u", "create", "events.k8s.io/events"), 1);
    }
}
