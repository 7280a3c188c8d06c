//! Which webhooks a request calls: kube-apiserver's `ShouldCallHook` (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/generic/webhook.go`) with the
//! predicates it asks, read in the same tree:
//!
//! - `predicates/namespace/matcher.go`, `MatchNamespaceSelector`: a cluster-scoped object
//!   (other than a Namespace) always matches; an empty selector matches; otherwise the labels of
//!   the request's Namespace object are matched (those of the object itself when a Namespace
//!   is created or updated), and a namespace that does not exist is `404 NotFound`;
//! - `predicates/object/matcher.go`, `MatchObjectSelector`: the new or the old object's labels;
//! - `predicates/rules/rules.go`, `Matcher.Matches`: scope, operation, group, version and
//!   `resource[/subresource]`, each exact or `*`;
//! - `matchconditions/matcher.go`, `Match`: any condition false skips the webhook; otherwise
//!   an evaluation error follows the failure policy: `Fail` refuses the request with
//!   `NewForbidden` (403), `Ignore` skips the webhook.

use std::collections::BTreeMap;
use std::sync::Arc;

use cel::{Context, Env, Value as CelValue};
use k8s_openapi::api::admissionregistration::v1::{RuleWithOperations, ValidatingWebhook};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::{Value, json};

use super::super::meta_rules::group_of;
use super::super::{ApiError, ApiResult, ObjKey, State, qualified_resource};
use super::Attributes;

/// The label kube-apiserver's namespace strategy puts on every Namespace
/// (`pkg/registry/core/namespace/strategy.go`, `PrepareForCreate`/`PrepareForUpdate`).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// `rules.IsExemptAdmissionConfigurationResource`: writes of webhook configurations and
/// admission policies never go through webhooks, so a broken webhook cannot lock itself in.
pub(super) fn is_exempt(key: &ObjKey) -> bool {
    key.prefix.starts_with("apis/admissionregistration.k8s.io/")
        && matches!(
            key.resource.as_str(),
            "validatingwebhookconfigurations"
                | "mutatingwebhookconfigurations"
                | "validatingadmissionpolicies"
                | "validatingadmissionpolicybindings"
                | "mutatingadmissionpolicies"
                | "mutatingadmissionpolicybindings"
        )
}

/// `rules.Matcher.Matches` for one rule.
pub(super) fn rule_matches(rule: &RuleWithOperations, attributes: &Attributes<'_>) -> bool {
    let key = attributes.key;
    let exact_or_wildcard = |items: Option<&Vec<String>>, wanted: &str| {
        items.is_some_and(|items| items.iter().any(|i| i == "*" || i == wanted))
    };
    let is_namespace = key.prefix == "api/v1" && key.resource == "namespaces";
    let scope = match rule.scope.as_deref() {
        None | Some("*") => true,
        Some("Namespaced") => !is_namespace && !key.namespace.is_empty(),
        Some("Cluster") => is_namespace || key.namespace.is_empty(),
        Some(_) => false,
    };
    let resource = rule.resources.iter().flatten().any(|r| {
        let (res, sub) = r.split_once('/').unwrap_or((r, ""));
        (res == "*" || res == key.resource) && (sub == "*" || sub == attributes.subresource)
    });
    scope
        && exact_or_wildcard(rule.operations.as_ref(), attributes.operation.as_str())
        && exact_or_wildcard(rule.api_groups.as_ref(), &group_of(key))
        && exact_or_wildcard(rule.api_versions.as_ref(), attributes.version())
        && resource
}

/// Whether `labels` satisfy `selector` (`metav1.LabelSelectorAsSelector`, then
/// `Selector.Matches`); an empty selector matches everything.
///
/// # Errors
///
/// The text of `LabelSelectorAsSelector`'s error for an operator it does not know.
pub(super) fn selector_matches(
    selector: &LabelSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    let by_label = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let mut by_expression = true;
    for requirement in selector.match_expressions.iter().flatten() {
        let value = labels.get(&requirement.key);
        let values = requirement.values.as_deref().unwrap_or_default();
        let matches = match requirement.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            // A label that is absent is not in the set (`labels.Requirement.Matches`).
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => return Err(format!("{other:?} is not a valid label selector operator")),
        };
        by_expression &= matches;
    }
    Ok(by_label && by_expression)
}

fn labels_of(obj: Option<&Value>) -> BTreeMap<String, String> {
    obj.and_then(|o| o.pointer("/metadata/labels"))
        .and_then(|l| serde_json::from_value(l.clone()).ok())
        .unwrap_or_default()
}

fn is_empty(selector: Option<&LabelSelector>) -> bool {
    selector.is_none_or(|s| {
        s.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
            && s.match_expressions.as_ref().is_none_or(Vec::is_empty)
    })
}

impl State {
    /// The labels the namespace selector of a webhook sees for this request, with the label
    /// every namespace carries.
    fn namespace_labels(&self, attributes: &Attributes<'_>) -> ApiResult<BTreeMap<String, String>> {
        let key = attributes.key;
        let (name, mut labels) = if key.prefix == "api/v1"
            && key.resource == "namespaces"
            && attributes.subresource.is_empty()
            && attributes.operation != super::Operation::Delete
        {
            (key.name.clone(), labels_of(attributes.new))
        } else {
            let namespace_key = ObjKey {
                prefix: "api/v1".to_owned(),
                resource: "namespaces".to_owned(),
                namespace: String::new(),
                name: key.namespace.clone(),
            };
            let namespace = self.existing(&namespace_key)?;
            (key.namespace.clone(), labels_of(Some(&namespace)))
        };
        labels.insert(NAMESPACE_NAME_LABEL.to_owned(), name);
        Ok(labels)
    }

    /// `MatchNamespaceSelector`.
    fn namespace_matches(
        &self,
        hook: &ValidatingWebhook,
        attributes: &Attributes<'_>,
    ) -> ApiResult<bool> {
        let key = attributes.key;
        let is_namespace = key.prefix == "api/v1" && key.resource == "namespaces";
        let selector = hook.namespace_selector.as_ref();
        if (key.namespace.is_empty() && !is_namespace) || is_empty(selector) {
            return Ok(true);
        }
        let labels = self.namespace_labels(attributes)?;
        let selector = selector.cloned().unwrap_or_default();
        selector_matches(&selector, &labels).map_err(|e| internal_error(&e))
    }

    /// `ShouldCallHook` without the matchConditions: namespace selector, object selector and
    /// rules. A selector error is answered only for a webhook whose rules match.
    pub(super) fn webhook_applies(
        &self,
        hook: &ValidatingWebhook,
        attributes: &Attributes<'_>,
    ) -> ApiResult<bool> {
        let namespace = self.namespace_matches(hook, attributes);
        if matches!(namespace, Ok(false)) {
            return Ok(false);
        }
        let object = match hook.object_selector.as_ref() {
            selector if is_empty(selector) => Ok(true),
            Some(selector) => selector_matches(selector, &labels_of(attributes.new))
                .and_then(|new| Ok(new || selector_matches(selector, &labels_of(attributes.old))?))
                .map_err(|e| internal_error(&e)),
            None => Ok(true),
        };
        if matches!(object, Ok(false)) {
            return Ok(false);
        }
        if !hook
            .rules
            .iter()
            .flatten()
            .any(|rule| rule_matches(rule, attributes))
        {
            return Ok(false);
        }
        namespace?;
        object?;
        Ok(true)
    }
}

/// `apierrors.NewInternalError`.
pub(super) fn internal_error(message: &str) -> ApiError {
    let message_text = format!("Internal error occurred: {message}");
    let mut err = ApiError::new(500, message_text);
    err.details = Some(json!({"causes": [{"message": message}]}));
    err
}

/// Evaluates a webhook's `matchConditions` (`matchconditions.matcher.Match`) with `object`,
/// `oldObject` and `request` bound as upstream binds them; `authorizer` is not bound, so an
/// expression that uses it fails to evaluate.
///
/// # Errors
///
/// With `failurePolicy: Fail` (the default), evaluation errors and no condition false:
/// `NewForbidden` naming the resource and object, the errors as its message.
pub(super) fn conditions_match(
    env: &Arc<Env>,
    hook: &ValidatingWebhook,
    attributes: &Attributes<'_>,
    request: &Value,
) -> ApiResult<bool> {
    let Some(conditions) = hook.match_conditions.as_ref().filter(|c| !c.is_empty()) else {
        return Ok(true);
    };
    let mut context = Context::with_env(Arc::clone(env));
    let null = Value::Null;
    for (name, value) in [
        ("object", attributes.new.unwrap_or(&null)),
        ("oldObject", attributes.old.unwrap_or(&null)),
        ("request", request),
    ] {
        // serde_json values always convert into CEL values.
        context.add_variable_from_value(name, cel::to_value(value).unwrap_or(CelValue::Null));
    }
    let mut errors = Vec::new();
    for condition in conditions {
        let expression = condition.expression.trim();
        let outcome = env
            .compile(expression)
            .map_err(|e| format!("compilation failed: {e}"))
            .and_then(|program| {
                program
                    .execute(&context)
                    .map_err(|e| format!("expression '{expression}' resulted in error: {e}"))
            });
        match outcome {
            Ok(CelValue::Bool(true)) => {}
            Ok(CelValue::Bool(false)) => return Ok(false),
            Ok(other) => errors.push(format!(
                "expression '{expression}' resulted in error: expected a bool, got {:?}",
                other.type_of()
            )),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        return Ok(true);
    }
    if hook.failure_policy.as_deref() == Some("Ignore") {
        return Ok(false);
    }
    // `utilerrors.NewAggregate(...).Error()`: one error as itself, more in brackets.
    let aggregate = if errors.len() == 1 {
        errors.remove(0)
    } else {
        format!("[{}]", errors.join(", "))
    };
    Err(forbidden(attributes.key, &aggregate))
}

/// `apierrors.NewForbidden(resource, name, err)`.
fn forbidden(key: &ObjKey, message: &str) -> ApiError {
    let mut err = ApiError::new(
        403,
        format!(
            "{} {:?} is forbidden: {message}",
            qualified_resource(key),
            key.name
        ),
    );
    err.details = Some(json!({"name": key.name, "group": group_of(key), "kind": key.resource}));
    err
}
