//! Authorization of every request [`FakeApi`] serves, with the RBAC objects of kerf's
//! manifests (`deploy/helm/kerf/templates/*rbac*.yaml`), as kube-apiserver's RBAC authorizer decides it.
//!
//! Upstream (kubernetes/kubernetes):
//! - `plugin/pkg/auth/authorizer/rbac/rbac.go`: `RBACAuthorizer.Authorize` visits the rules
//!   that apply to the user and allows when one `RuleAllows` the request (`RulesAllow`);
//! - `pkg/registry/rbac/validation/rule.go`: `DefaultRuleResolver.VisitRulesFor` takes the
//!   rules of every ClusterRoleBinding, then of every RoleBinding in the request's namespace
//!   (whose `roleRef` may name a Role of that namespace or a ClusterRole), whose subjects
//!   apply to the user (`appliesToUser`: a User by name, a Group by membership, a
//!   ServiceAccount by `system:serviceaccount:<ns>:<name>`, its namespace defaulting to the
//!   binding's);
//! - `pkg/apis/rbac/v1/evaluation_helpers.go`: `VerbMatches`, `APIGroupMatches`,
//!   `ResourceMatches` (`*`, the exact `resource/subresource`, or `*/<subresource>`; a rule
//!   `pods/*` is no wildcard there and matches only a resource literally named so),
//!   `ResourceNameMatches` (no names: every name), `NonResourceURLMatches`;
//! - the privileged-group authorizer (`pkg/kubeapiserver/authorizer`, `authorizerfactory.
//!   NewPrivilegedGroups`) allows `system:masters` everything before RBAC is asked;
//! - a denial is `403 Forbidden` with the message of `responsewriters.Forbidden`
//!   (`staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go`,
//!   `forbiddenMessage` inside `apierrors.NewForbidden`).
//!
//! Not imitated: aggregated ClusterRoles (`aggregationRule`; kerf has none), the Node and
//! webhook authorizers, impersonation, and kube-apiserver's own bootstrap roles (kerf's
//! components hold only what deploy/ grants them, `system:basic-user` discovery aside, which
//! kube clients do not call here).
//!
//! The synthetic checks made after a request is authorized (the ResourceClaim status
//! subresources of 1.36, the `create` of a server-side apply that creates) are in `writes`.

mod attributes;
mod writes;

pub use attributes::Attributes;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use serde_json::Value;

use super::{ApiError, FakeApi, Identity};

/// The manifests every [`FakeApi`] authorizes with: the RBAC objects of the chart's default
/// install.
pub const KERF_RBAC_MANIFESTS: [(&str, &str); 1] =
    [(crate::manifests::INSTALL_PATH, crate::manifests::INSTALL)];

/// The group kube-apiserver allows everything (`user.SystemPrivilegedGroup`).
const PRIVILEGED_GROUP: &str = "system:masters";

/// Why RBAC manifests cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum RbacError {
    /// A file is not YAML.
    #[error("{origin}: invalid YAML: {message}")]
    Yaml {
        /// The file.
        origin: String,
        /// The parser's message.
        message: String,
    },
    /// A document is not a valid RBAC object of its kind.
    #[error("{origin}: document {document} ({kind}): {message}")]
    Object {
        /// The file.
        origin: String,
        /// 1-based document index.
        document: usize,
        /// The document's kind.
        kind: String,
        /// The decoder's message.
        message: String,
    },
}

/// Where a rule comes from: its role and its index in the role's `rules`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleSource {
    /// `ClusterRole` or `Role`.
    pub kind: &'static str,
    /// The role's namespace (empty for a ClusterRole).
    pub namespace: String,
    /// The role's name.
    pub name: String,
    /// The rule's index in the role.
    pub index: usize,
}

impl fmt::Display for RuleSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {} rule {}", self.kind, self.name, self.index)
        } else {
            write!(
                f,
                "{} {}/{} rule {}",
                self.kind, self.namespace, self.name, self.index
            )
        }
    }
}

/// One rule granted to one subject through one binding.
#[derive(Debug, Clone)]
pub struct Grant {
    /// The subject as written in the binding.
    pub subject: Subject,
    /// The binding's namespace: empty for a ClusterRoleBinding (every namespace).
    pub scope: String,
    /// The rule's role and index.
    pub source: RuleSource,
    /// The rule.
    pub rule: PolicyRule,
}

/// The RBAC objects of a set of manifests.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    cluster_roles: BTreeMap<String, Vec<PolicyRule>>,
    roles: BTreeMap<(String, String), Vec<PolicyRule>>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    role_bindings: Vec<RoleBinding>,
    /// Every rule of every binding per subject, rebuilt by each [`Policy::add_yaml`] so that
    /// authorizing a request clones nothing.
    grants: Vec<Grant>,
}

impl Policy {
    /// The policy of [`KERF_RBAC_MANIFESTS`].
    ///
    /// # Errors
    /// A manifest does not parse ([`RbacError`]).
    pub fn kerf_manifests() -> Result<Self, RbacError> {
        let mut policy = Self::default();
        for (origin, text) in KERF_RBAC_MANIFESTS {
            policy.add_yaml(origin, text)?;
        }
        Ok(policy)
    }

    /// Adds the ClusterRoles, ClusterRoleBindings, Roles and RoleBindings of `text` (YAML, one
    /// or more documents); other kinds are skipped. `origin` names the file in errors.
    ///
    /// # Errors
    /// The YAML does not parse, or an RBAC document does not decode into its k8s-openapi type.
    pub fn add_yaml(&mut self, origin: &str, text: &str) -> Result<(), RbacError> {
        let documents: Vec<Value> =
            serde_saphyr::from_multiple(text).map_err(|e| RbacError::Yaml {
                origin: origin.to_owned(),
                message: e.to_string(),
            })?;
        for (index, document) in documents.into_iter().enumerate() {
            let kind = document
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let error = |e: serde_json::Error| RbacError::Object {
                origin: origin.to_owned(),
                document: index + 1,
                kind: kind.clone(),
                message: e.to_string(),
            };
            match kind.as_str() {
                "ClusterRole" => {
                    let role: ClusterRole = serde_json::from_value(document).map_err(error)?;
                    let name = role.metadata.name.unwrap_or_default();
                    self.cluster_roles
                        .insert(name, role.rules.unwrap_or_default());
                }
                "Role" => {
                    let role: Role = serde_json::from_value(document).map_err(error)?;
                    let key = (
                        role.metadata.namespace.unwrap_or_default(),
                        role.metadata.name.unwrap_or_default(),
                    );
                    self.roles.insert(key, role.rules.unwrap_or_default());
                }
                "ClusterRoleBinding" => self
                    .cluster_role_bindings
                    .push(serde_json::from_value(document).map_err(error)?),
                "RoleBinding" => self
                    .role_bindings
                    .push(serde_json::from_value(document).map_err(error)?),
                _ => {}
            }
        }
        self.grants = self.bound_rules();
        Ok(())
    }

    /// The rules of the role `role_ref` names, for a binding in `namespace` (empty for a
    /// ClusterRoleBinding): `GetRoleReferenceRules`. A missing role grants nothing.
    fn referenced_rules(
        &self,
        role_ref: &RoleRef,
        namespace: &str,
    ) -> Vec<(RuleSource, &PolicyRule)> {
        let (kind, namespace, rules) = match role_ref.kind.as_str() {
            "ClusterRole" => ("ClusterRole", "", self.cluster_roles.get(&role_ref.name)),
            "Role" => (
                "Role",
                namespace,
                self.roles
                    .get(&(namespace.to_owned(), role_ref.name.clone())),
            ),
            _ => return Vec::new(),
        };
        rules
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(index, rule)| {
                let source = RuleSource {
                    kind,
                    namespace: namespace.to_owned(),
                    name: role_ref.name.clone(),
                    index,
                };
                (source, rule)
            })
            .collect()
    }

    /// Every rule of every binding, with each subject it is bound to.
    pub fn grants(&self) -> &[Grant] {
        &self.grants
    }

    fn bound_rules(&self) -> Vec<Grant> {
        let cluster = self.cluster_role_bindings.iter().map(|b| {
            (
                String::new(),
                &b.role_ref,
                b.subjects.as_deref().unwrap_or_default(),
            )
        });
        let namespaced = self.role_bindings.iter().map(|b| {
            (
                b.metadata.namespace.clone().unwrap_or_default(),
                &b.role_ref,
                b.subjects.as_deref().unwrap_or_default(),
            )
        });
        let mut grants = Vec::new();
        for (scope, role_ref, subjects) in cluster.chain(namespaced) {
            for (source, rule) in self.referenced_rules(role_ref, &scope) {
                grants.extend(subjects.iter().map(|subject| Grant {
                    subject: subject.clone(),
                    scope: scope.clone(),
                    source: source.clone(),
                    rule: rule.clone(),
                }));
            }
        }
        grants
    }

    /// Every rule that allows `user` the request `attributes` (empty: RBAC has no opinion,
    /// which is a denial). Where `Authorize` stops at the first, this returns all of them, so
    /// that a test can tell which rules a flow needs.
    pub fn allowing_rules(&self, user: &Identity, attributes: &Attributes) -> Vec<RuleSource> {
        let mut allowing: Vec<RuleSource> = self
            .grants
            .iter()
            .filter(|grant| grant.scope.is_empty() || grant.scope == attributes.namespace)
            .filter(|grant| applies_to(user, &grant.subject, &grant.scope))
            .filter(|grant| rule_allows(attributes, &grant.rule))
            .map(|grant| grant.source.clone())
            .collect();
        allowing.sort();
        allowing.dedup();
        allowing
    }

    /// Whether `user` may make the request `attributes`: a member of `system:masters`, or
    /// allowed by a rule.
    pub fn allows(&self, user: &Identity, attributes: &Attributes) -> bool {
        is_privileged(user) || !self.allowing_rules(user, attributes).is_empty()
    }
}

/// Whether `user` is in `system:masters`.
fn is_privileged(user: &Identity) -> bool {
    user.groups.iter().any(|g| g == PRIVILEGED_GROUP)
}

/// `appliesToUser`: whether a binding's subject names `user`; a ServiceAccount subject
/// without a namespace takes the binding's (`scope`), and matches nothing in a
/// ClusterRoleBinding.
fn applies_to(user: &Identity, subject: &Subject, scope: &str) -> bool {
    match subject.kind.as_str() {
        "User" => user.username == subject.name,
        "Group" => user.groups.contains(&subject.name),
        "ServiceAccount" => {
            let namespace = subject
                .namespace
                .as_deref()
                .filter(|ns| !ns.is_empty())
                .unwrap_or(scope);
            !namespace.is_empty()
                && user.username == format!("system:serviceaccount:{namespace}:{}", subject.name)
        }
        _ => false,
    }
}

/// `RuleAllows`.
fn rule_allows(attributes: &Attributes, rule: &PolicyRule) -> bool {
    let verb = rule.verbs.iter().any(|v| v == "*" || *v == attributes.verb);
    if !attributes.resource_request {
        return verb && non_resource_url_matches(rule, &attributes.path);
    }
    verb && api_group_matches(rule, &attributes.api_group)
        && resource_matches(
            rule,
            &attributes.combined_resource(),
            &attributes.subresource,
        )
        && resource_name_matches(rule, &attributes.name)
}

/// `APIGroupMatches`.
fn api_group_matches(rule: &PolicyRule, group: &str) -> bool {
    rule.api_groups
        .iter()
        .flatten()
        .any(|g| g == "*" || g == group)
}

/// `ResourceMatches`: `*`, the exact combined resource, or `*/<subresource>`.
fn resource_matches(rule: &PolicyRule, combined: &str, subresource: &str) -> bool {
    rule.resources.iter().flatten().any(|r| {
        r == "*"
            || r == combined
            || (!subresource.is_empty()
                && r.strip_prefix("*/").is_some_and(|sub| sub == subresource))
    })
}

/// `ResourceNameMatches`: a rule without names matches every name.
fn resource_name_matches(rule: &PolicyRule, name: &str) -> bool {
    match rule.resource_names.as_deref() {
        None | Some([]) => true,
        Some(names) => names.iter().any(|n| n == name),
    }
}

/// `NonResourceURLMatches`: `*`, the exact path, or a prefix ending in `*`.
fn non_resource_url_matches(rule: &PolicyRule, path: &str) -> bool {
    rule.non_resource_urls.iter().flatten().any(|url| {
        url == "*"
            || url == path
            || url
                .strip_suffix('*')
                .is_some_and(|prefix| path.starts_with(prefix))
    })
}

/// One authorization decision [`FakeApi`] made for a user outside `system:masters`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The user.
    pub user: String,
    /// What was asked (for the synthetic checks of `writes`, their synthetic verb and
    /// subresource).
    pub attributes: Attributes,
    /// Whether it was allowed.
    pub allowed: bool,
}

/// A [`FakeApi`]'s authorizer: the policy of kerf's manifests, loaded once, and the log of
/// its decisions.
#[derive(Debug)]
pub(super) struct Authorizer {
    /// The error when the manifests do not parse: then every request outside
    /// `system:masters` is answered with it (500), so that no test passes on a policy it
    /// did not read.
    policy: Result<Policy, String>,
    checks: Mutex<Vec<Check>>,
}

impl Authorizer {
    /// The authorizer of [`KERF_RBAC_MANIFESTS`].
    pub(super) fn kerf() -> Self {
        Self {
            policy: Policy::kerf_manifests().map_err(|e| e.to_string()),
            checks: Mutex::new(Vec::new()),
        }
    }

    /// Authorizes `attributes` for `user`; a denial is the API server's `403`.
    pub(super) fn authorize(
        &self,
        user: &Identity,
        attributes: &Attributes,
    ) -> Result<(), ApiError> {
        if is_privileged(user) {
            return Ok(());
        }
        let policy = self.policy.as_ref().map_err(|e| {
            ApiError::new(
                500,
                format!("FakeApi cannot read kerf's RBAC manifests: {e}"),
            )
        })?;
        let allowed = policy.allows(user, attributes);
        self.checks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Check {
                user: user.username.clone(),
                attributes: attributes.clone(),
                allowed,
            });
        if allowed {
            Ok(())
        } else {
            Err(forbidden(user, attributes, ""))
        }
    }
}

/// `responsewriters.Forbidden`: `apierrors.NewForbidden(group resource, name,
/// forbiddenMessage(attributes) [+ ": " + reason])`.
pub(super) fn forbidden(user: &Identity, attributes: &Attributes, reason: &str) -> ApiError {
    let mut message = forbidden_message(user, attributes);
    if !reason.is_empty() {
        message = format!("{message}: {reason}");
    }
    ApiError::new(403, new_forbidden(attributes, &message))
}

/// `apierrors.NewForbidden`'s message: `<resource>[.<group>] ["<name>"] is forbidden: <why>`.
pub(super) fn new_forbidden(attributes: &Attributes, why: &str) -> String {
    if !attributes.resource_request || attributes.resource.is_empty() {
        return format!("forbidden: {why}");
    }
    let resource = if attributes.api_group.is_empty() {
        attributes.resource.clone()
    } else {
        format!("{}.{}", attributes.resource, attributes.api_group)
    };
    if attributes.name.is_empty() {
        format!("{resource} is forbidden: {why}")
    } else {
        format!("{resource} {:?} is forbidden: {why}", attributes.name)
    }
}

/// `forbiddenMessage`.
fn forbidden_message(user: &Identity, attributes: &Attributes) -> String {
    let username = &user.username;
    let verb = &attributes.verb;
    if !attributes.resource_request {
        return format!("User {username:?} cannot {verb} path {:?}", attributes.path);
    }
    let resource = attributes.combined_resource();
    let group = &attributes.api_group;
    if attributes.namespace.is_empty() {
        format!(
            "User {username:?} cannot {verb} resource {resource:?} in API group {group:?} at the cluster scope"
        )
    } else {
        format!(
            "User {username:?} cannot {verb} resource {resource:?} in API group {group:?} in the namespace {:?}",
            attributes.namespace
        )
    }
}

impl FakeApi {
    /// Every authorization decision made so far for users outside `system:masters`, in
    /// order: one per request, plus the synthetic checks of ResourceClaim status writes and
    /// of server-side applies that create.
    pub fn authorization_checks(&self) -> Vec<Check> {
        self.inner
            .rbac
            .checks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests;
