//! The `matchConditions` of the claim webhooks in `deploy/helm/kerf/templates/webhook.yaml` select exactly
//! the claims and templates with an opaque config of kerf's driver, and never fail to evaluate.
//!
//! Upstream: kube-apiserver evaluates a webhook's `matchConditions` (CEL, with the variable
//! `object` bound to the object converted to the webhook's version, as an untyped map) before
//! calling it; the webhook is called only when all are true, and an evaluation error counts
//! as a webhook failure, which `failurePolicy: Fail` turns into a refusal of the request
//! (`staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions/matcher.go`,
//! `Matcher.Match`). So a missing field must be guarded with `has()`, as here, not read.
//!
//! The expressions run in the [`cel`] crate, a real CEL parser and interpreter, with `object`
//! bound to the JSON objects below.

use cel::{Context, Program};
use serde_json::{Value, json};

use kerf_tests::fixtures::DRIVER;

fn webhook_yaml() -> Vec<Value> {
    let manifests = kerf_tests::manifests::INSTALL;
    kerf_tests::manifests::documents("deploy/kerf.yaml", manifests).unwrap()
}

/// The claim webhooks: (resource of its rule, its matchCondition expressions).
fn claim_webhooks() -> Vec<(String, Vec<String>)> {
    let documents = webhook_yaml();
    let configuration = documents
        .iter()
        .find(|d| d["metadata"]["name"] == "kerf-claim-parameters")
        .expect("kerf-claim-parameters in deploy/kerf.yaml");
    configuration["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|webhook| {
            assert_eq!(webhook["failurePolicy"], "Fail", "{webhook}");
            assert_eq!(webhook["sideEffects"], "None", "{webhook}");
            assert_eq!(webhook["matchPolicy"], "Equivalent", "{webhook}");
            assert_eq!(
                webhook["namespaceSelector"]["matchExpressions"][0]["values"],
                json!(["kube-system"])
            );
            let rules = webhook["rules"].as_array().unwrap();
            assert_eq!(rules.len(), 1, "{webhook}");
            assert_eq!(rules[0]["operations"], json!(["CREATE"]));
            assert_eq!(rules[0]["apiGroups"], json!(["resource.k8s.io"]));
            assert_eq!(rules[0]["apiVersions"], json!(["v1"]));
            let resources = rules[0]["resources"].as_array().unwrap();
            assert_eq!(resources.len(), 1, "{webhook}");
            let expressions = webhook["matchConditions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["expression"].as_str().unwrap().to_owned())
                .collect();
            (resources[0].as_str().unwrap().to_owned(), expressions)
        })
        .collect()
}

/// A user who creates claims and templates by hand.
const USER: &str = "alice";
/// kube-controller-manager's resourceclaim controller, with `--use-service-account-credentials`
/// (`cmd/kube-controller-manager/app/core.go`, `startResourceClaimController`, client
/// `resource-claim-controller`) and without it.
const CLAIM_CONTROLLER_NAMES: [&str; 2] = [
    "system:serviceaccount:kube-system:resource-claim-controller",
    "system:kube-controller-manager",
];

/// Whether every expression is true for `object` created by `USER`; an evaluation error fails
/// the test.
fn matches(expressions: &[String], object: &Value) -> bool {
    matches_from(
        expressions,
        object,
        &json!({"username": USER, "groups": ["system:authenticated"]}),
    )
}

/// Whether every expression is true for `object` created by `user_info` (the request's
/// `userInfo`); an evaluation error fails the test.
fn matches_from(expressions: &[String], object: &Value, user_info: &Value) -> bool {
    let mut context = Context::default();
    context.add_variable_from_value("object", cel::to_value(object).unwrap());
    let request = json!({"operation": "CREATE", "userInfo": user_info});
    context.add_variable_from_value("request", cel::to_value(&request).unwrap());
    expressions.iter().all(|expression| {
        let program = Program::compile(expression).unwrap();
        match program.execute(&context) {
            Ok(cel::Value::Bool(b)) => b,
            other => panic!("{expression} on {object}: {other:?}"),
        }
    })
}

fn opaque(driver: &str) -> Value {
    json!({"requests": ["gpu"], "opaque": {"driver": driver, "parameters": {"a": 1}}})
}

/// (devices, whether it has a kerf config): the shapes a claim's `spec.devices` takes.
fn device_shapes() -> Vec<(Option<Value>, bool)> {
    let requests = json!([{"name": "gpu", "exactly": {"deviceClassName": "c"}}]);
    vec![
        (
            Some(json!({"requests": requests, "config": [opaque(DRIVER)]})),
            true,
        ),
        (
            Some(
                json!({"requests": requests, "config": [opaque("other.example.com"), {"requests": ["gpu"]}, opaque(DRIVER)]}),
            ),
            true,
        ),
        (
            Some(json!({"requests": requests, "config": [opaque("other.example.com")]})),
            false,
        ),
        // A config that is not opaque, and an opaque one whose driver merely contains kerf's.
        (
            Some(json!({"requests": requests, "config": [{"requests": ["gpu"]}]})),
            false,
        ),
        (
            Some(json!({"requests": requests, "config": [opaque("x.gpu.kerf.dev")]})),
            false,
        ),
        (Some(json!({"requests": requests, "config": []})), false),
        (Some(json!({"requests": requests})), false),
        (Some(json!({})), false),
        (None, false),
    ]
}

fn claim(devices: Option<&Value>) -> Value {
    let mut spec = json!({});
    if let Some(devices) = devices {
        spec["devices"] = devices.clone();
    }
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "c", "namespace": "default"}, "spec": spec})
}

fn template(devices: Option<&Value>) -> Value {
    let mut spec = json!({});
    if let Some(devices) = devices {
        spec["devices"] = devices.clone();
    }
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
           "metadata": {"name": "t", "namespace": "default"}, "spec": {"spec": spec}})
}

#[test]
fn claim_webhooks_select_exactly_objects_with_a_kerf_config() {
    let webhooks = claim_webhooks();
    let resources: Vec<&str> = webhooks.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(resources, ["resourceclaims", "resourceclaimtemplates"]);
    for (resource, expressions) in &webhooks {
        for (devices, kerf) in device_shapes() {
            let (own, other) = match resource.as_str() {
                "resourceclaims" => (claim(devices.as_ref()), template(devices.as_ref())),
                _ => (template(devices.as_ref()), claim(devices.as_ref())),
            };
            assert_eq!(matches(expressions, &own), kerf, "{resource}: {own}");
            // The other resource's shape never matches (and does not error).
            assert!(!matches(expressions, &other), "{resource}: {other}");
        }
        // Objects missing even `spec` (or a template without `spec.spec`) do not error.
        assert!(!matches(expressions, &json!({"metadata": {"name": "x"}})));
        assert!(!matches(expressions, &json!({"spec": {}})));
    }
}

#[test]
fn claims_the_resourceclaim_controller_makes_from_templates_skip_the_claim_webhook() {
    let webhooks = claim_webhooks();
    let (_, claim_expressions) = &webhooks[0];
    let (_, template_expressions) = &webhooks[1];
    let kerf_devices = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "c"}}],
                              "config": [opaque(DRIVER)]});
    let kerf_claim = claim(Some(&kerf_devices));
    for name in CLAIM_CONTROLLER_NAMES {
        let controller = json!({"username": name, "groups": ["system:serviceaccounts"]});
        assert!(
            !matches_from(claim_expressions, &kerf_claim, &controller),
            "{name}"
        );
        // A template made by that identity is still checked (none is, but nothing is skipped
        // that was not checked before).
        let kerf_template = template(Some(&kerf_devices));
        assert!(
            matches_from(template_expressions, &kerf_template, &controller),
            "{name}"
        );
    }
    // Another service account, and a request without a username, are checked.
    let other = json!({"username": "system:serviceaccount:ci:deployer"});
    assert!(matches_from(claim_expressions, &kerf_claim, &other));
    assert!(matches_from(claim_expressions, &kerf_claim, &json!({})));
}
