//! `ShouldCallHook`'s predicates on their own: rules (`predicates/rules/rules.go`) and label
//! selectors (`metav1.LabelSelectorAsSelector`), as kubernetes/kubernetes words them.

use k8s_openapi::api::admissionregistration::v1::RuleWithOperations;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::{Value, json};

use super::super::ObjKey;
use super::matching::{rule_matches, selector_matches};
use super::{Attributes, Operation};

fn key(prefix: &str, resource: &str, namespace: &str) -> ObjKey {
    ObjKey {
        prefix: prefix.to_owned(),
        resource: resource.to_owned(),
        namespace: namespace.to_owned(),
        name: "n".to_owned(),
    }
}

fn rule(value: &Value) -> RuleWithOperations {
    serde_json::from_value(value.clone()).unwrap()
}

fn matches(
    rule_json: &Value,
    operation: Operation,
    key: &ObjKey,
    subresource: &'static str,
) -> bool {
    let attributes = Attributes {
        operation,
        key,
        subresource,
        old: None,
        new: None,
    };
    rule_matches(&rule(rule_json), &attributes)
}

#[test]
fn rules_match_group_version_resource_operation_and_scope() {
    let claims = key("apis/resource.k8s.io/v1", "resourceclaims", "team-a");
    let exact = json!({"operations": ["CREATE"], "apiGroups": ["resource.k8s.io"],
        "apiVersions": ["v1"], "resources": ["resourceclaims"], "scope": "Namespaced"});
    assert!(matches(&exact, Operation::Create, &claims, ""));
    assert!(!matches(&exact, Operation::Update, &claims, ""));
    // A rule for the resource does not match its subresources, nor another version.
    assert!(!matches(&exact, Operation::Create, &claims, "status"));
    let beta = key("apis/resource.k8s.io/v1beta2", "resourceclaims", "team-a");
    assert!(!matches(&exact, Operation::Create, &beta, ""));
    let wildcard = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"],
        "resources": ["*/*"]});
    assert!(matches(&wildcard, Operation::Delete, &claims, "status"));
    let status = json!({"operations": ["UPDATE"], "apiGroups": ["resource.k8s.io"],
        "apiVersions": ["v1"], "resources": ["resourceclaims/status"]});
    assert!(matches(&status, Operation::Update, &claims, "status"));
    assert!(!matches(&status, Operation::Update, &claims, ""));
    // Scope: a Namespace is cluster-scoped, whatever it names.
    let cluster = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"],
        "resources": ["*"], "scope": "Cluster"});
    assert!(!matches(&cluster, Operation::Create, &claims, ""));
    assert!(matches(
        &cluster,
        Operation::Create,
        &key("api/v1", "namespaces", ""),
        ""
    ));
    assert!(matches(
        &cluster,
        Operation::Create,
        &key("api/v1", "nodes", ""),
        ""
    ));
    let namespaced = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"],
        "resources": ["*"], "scope": "Namespaced"});
    assert!(!matches(
        &namespaced,
        Operation::Create,
        &key("api/v1", "namespaces", ""),
        ""
    ));
}

fn selector(value: &Value) -> LabelSelector {
    serde_json::from_value(value.clone()).unwrap()
}

#[test]
fn label_selectors_follow_the_requirement_operators() {
    let labels = [("quota".to_owned(), "on".to_owned())].into();
    let check = |s: Value| selector_matches(&selector(&s), &labels);
    assert_eq!(check(json!({})), Ok(true));
    assert_eq!(check(json!({"matchLabels": {"quota": "on"}})), Ok(true));
    assert_eq!(check(json!({"matchLabels": {"quota": "off"}})), Ok(false));
    let expression = |operator: &str, values: Value| {
        check(
            json!({"matchExpressions": [{"key": "quota", "operator": operator, "values": values}]}),
        )
    };
    assert_eq!(expression("In", json!(["on", "maybe"])), Ok(true));
    assert_eq!(expression("NotIn", json!(["on"])), Ok(false));
    assert_eq!(expression("Exists", json!([])), Ok(true));
    assert_eq!(expression("DoesNotExist", json!([])), Ok(false));
    // An absent label is not in any set.
    let absent = check(json!({"matchExpressions": [
        {"key": "team", "operator": "NotIn", "values": ["a"]}]}));
    assert_eq!(absent, Ok(true));
    assert_eq!(
        expression("Near", json!([])),
        Err("\"Near\" is not a valid label selector operator".to_owned())
    );
}
