//! kerf's permission surface: each component runs a representative flow against one
//! [`FakeApi`] as its own ServiceAccount (`permissions/flow.rs`), and the test prints the
//! distinct (verb, resource, subresource) each one was authorized for
//! (`cargo test -p kerf-tests --test integration permissions:: -- --nocapture`). Every request must be
//! allowed by `deploy/helm/kerf/templates/*rbac*.yaml`, and every right deploy/ grants — each (apiGroup,
//! resource, verb, resourceName) of each rule — must be used by the flow or be listed in
//! [`NOT_EXERCISED`] with the reason no test can use it (least privilege: a right nothing
//! uses is a right nobody should hold).

mod flow;
mod quota_flow;

use std::collections::{BTreeMap, BTreeSet};

use crate::common::mps::MpsNode;
use kerf_tests::fake_api::{Attributes, Check, FakeApi, Grant, Identity, Policy, RuleSource};

/// Rights deploy/ grants that no flow can show to be needed, each with why it is granted.
const NOT_EXERCISED: &[(&str, &str)] = &[(
    "kerf-controller: update gpuclasses/finalizers (gpu.kerf.dev)",
    "checked only by the OwnerReferencesPermissionEnforcement admission plugin (off by \
     default, not imitated by FakeApi), when the DeviceClass's owner reference to its \
     GpuClass sets blockOwnerDeletion",
)];

/// One right: a verb on a resource (`resource/subresource`) of an API group, limited to one
/// name or not, granted to a ServiceAccount by one rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Right {
    /// The ServiceAccount's name.
    account: String,
    verb: String,
    resource: String,
    api_group: String,
    /// Empty: any name.
    name: String,
}

impl std::fmt::Display for Right {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.api_group.is_empty() {
            "core"
        } else {
            &self.api_group
        };
        write!(f, "{}: {} {}", self.account, self.verb, self.resource)?;
        if !self.name.is_empty() {
            write!(f, " {:?}", self.name)?;
        }
        write!(f, " ({group})")
    }
}

/// Every right of `grant`, one per group × resource × verb × name.
fn rights_of(grant: &Grant) -> Vec<(RuleSource, Right)> {
    let rule = &grant.rule;
    let names = match rule.resource_names.as_deref() {
        None | Some([]) => vec![String::new()],
        Some(names) => names.to_vec(),
    };
    let mut rights = Vec::new();
    for api_group in rule.api_groups.iter().flatten() {
        for resource in rule.resources.iter().flatten() {
            for verb in &rule.verbs {
                for name in &names {
                    let right = Right {
                        account: grant.subject.name.clone(),
                        verb: verb.clone(),
                        resource: resource.clone(),
                        api_group: api_group.clone(),
                        name: name.clone(),
                    };
                    rights.push((grant.source.clone(), right));
                }
            }
        }
    }
    rights
}

/// Whether the request `attributes`, allowed by the rule `source`, used `right` of that rule.
fn uses(attributes: &Attributes, right: &Right) -> bool {
    attributes.verb == right.verb
        && attributes.api_group == right.api_group
        && attributes.combined_resource() == right.resource
        && (right.name.is_empty() || attributes.name == right.name)
}

/// `system:serviceaccount:<ns>:<name>` as its identity (groups only; RBAC needs no node).
fn identity_of(username: &str) -> Identity {
    match username
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
    {
        Some((namespace, name)) => Identity::service_account(namespace, name),
        None => Identity {
            username: username.to_owned(),
            groups: Vec::new(),
            extra: BTreeMap::new(),
        },
    }
}

/// Prints each identity's distinct `verb resource[/subresource]`, sorted.
fn print_surface(checks: &[Check]) {
    let mut surface: BTreeMap<&str, BTreeSet<(String, String)>> = BTreeMap::new();
    for check in checks {
        let a = &check.attributes;
        surface
            .entry(check.user.as_str())
            .or_default()
            .insert((a.verb.clone(), a.combined_resource()));
    }
    for (user, used) in &surface {
        eprintln!("{user}:");
        for (verb, resource) in used {
            eprintln!("  {verb} {resource}");
        }
    }
}

/// The rights of `policy` no allowed check in `checks` used.
fn unused_rights(policy: &Policy, checks: &[Check]) -> BTreeSet<Right> {
    let granted: Vec<(RuleSource, Right)> = policy.grants().iter().flat_map(rights_of).collect();
    let mut unused: BTreeSet<Right> = granted.iter().map(|(_, r)| r.clone()).collect();
    for check in checks.iter().filter(|c| c.allowed) {
        for source in policy.allowing_rules(&identity_of(&check.user), &check.attributes) {
            for (_, right) in granted
                .iter()
                .filter(|(s, r)| *s == source && uses(&check.attributes, r))
            {
                unused.remove(right);
            }
        }
    }
    unused
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_allowed_and_every_granted_right_is_used() {
    let on = MpsNode::with_profile("h100-sxm-80gb:2");
    flow::ready_node(&on.node.api);
    let (plugin, runner) = flow::plugin(&on).await;
    flow::controller(&on.node.api).await;
    // On a clean shutdown the plugin deletes its slices.
    plugin.shutdown().await.unwrap();
    drop(runner);
    let fake: &FakeApi = &on.node.api;
    let checks = fake.authorization_checks();
    print_surface(&checks);
    let denied: Vec<&Check> = checks.iter().filter(|c| !c.allowed).collect();
    assert!(denied.is_empty(), "denied: {denied:#?}");

    let policy = Policy::kerf_manifests().unwrap();
    let unused = unused_rights(&policy, &checks);
    let listed: BTreeSet<&str> = NOT_EXERCISED.iter().map(|(right, _)| *right).collect();
    let unexplained: Vec<String> = unused
        .iter()
        .map(ToString::to_string)
        .filter(|right| !listed.contains(right.as_str()))
        .collect();
    assert!(
        unexplained.is_empty(),
        "rights deploy/ grants that the flow does not use (remove them from \
         deploy/helm/kerf/templates/*rbac*.yaml, make the flow use them, or list them in NOT_EXERCISED with \
         the reason): {unexplained:#?}"
    );
    let unused_names: BTreeSet<String> = unused.iter().map(ToString::to_string).collect();
    let stale: Vec<&&str> = listed
        .iter()
        .filter(|right| !unused_names.contains(**right))
        .collect();
    assert!(
        stale.is_empty(),
        "listed in NOT_EXERCISED but used by the flow or not granted at all: {stale:?}"
    );
}
