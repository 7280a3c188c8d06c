use proptest::prelude::*;
use serde_json::json;

use super::*;

const DRIVER: &str = "gpu.kerf.dev";

fn params(fields: &Value) -> Value {
    let mut object = json!({"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters"});
    for (key, value) in fields.as_object().unwrap() {
        object[key] = value.clone();
    }
    object
}

fn claim(configs: &Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "slices"}}],
            "config": configs,
        }},
    })
}

fn template(configs: &Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "slices"}}],
            "config": configs,
        }}},
    })
}

fn opaque(driver: &str, parameters: &Value) -> Value {
    json!({"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}})
}

/// Applies the decision's patch as kube-apiserver does (RFC 6902), returning the result.
fn apply(object: &Value, decision: &ClaimDecision) -> Value {
    let ClaimDecision::Normalize { patch, .. } = decision else {
        panic!("expected a patch, got {decision:?}");
    };
    let patch: json_patch::Patch = serde_json::from_str(patch).unwrap();
    let mut patched = object.clone();
    json_patch::patch(&mut patched, &patch).unwrap();
    patched
}

fn invalid(decision: ClaimDecision) -> (String, String) {
    match decision {
        ClaimDecision::Invalid { field, message } => (field, message),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn spaced_parameters_are_replaced_by_compact_sorted_bytes() {
    // As Python's json.dumps writes them: ", " and ": " separators, keys in writing order.
    let written = r#"{"memory": "10Gi", "kind": "GpuClaimParameters", "apiVersion": "gpu.kerf.dev/v1alpha1", "compute": 50, "topology": {"scope": "NVLink"}}"#;
    let object = claim(&json!([opaque(
        DRIVER,
        &serde_json::from_str(written).unwrap()
    )]));
    let decision = decide_claim(&object, ClaimResource::Claim, DRIVER);
    let expected = r#"{"apiVersion":"gpu.kerf.dev/v1alpha1","compute":50,"kind":"GpuClaimParameters","memory":"10Gi","topology":{"scope":"NVLink"}}"#;
    assert_eq!(
        decision,
        ClaimDecision::Normalize {
            patch: format!(
                r#"[{{"op":"replace","path":"/spec/devices/config/0/opaque/parameters","value":{expected}}}]"#
            ),
            configs: 1,
        }
    );
    let patched = apply(&object, &decision);
    let stored = &patched["spec"]["devices"]["config"][0]["opaque"]["parameters"];
    assert_eq!(canonical(stored), expected);
    // Everything but the parameters is as it was.
    let mut without = patched.clone();
    without["spec"]["devices"]["config"][0]["opaque"]["parameters"] = Value::Null;
    let mut original = object.clone();
    original["spec"]["devices"]["config"][0]["opaque"]["parameters"] = Value::Null;
    assert_eq!(without, original);
}

#[test]
fn normalizing_is_idempotent() {
    let object = claim(&json!([
        opaque(DRIVER, &params(&json!({"memory": "4Gi", "sharing": "MPS"}))),
        opaque("other.example.com", &json!({"b": 1, "a": 2})),
        opaque(DRIVER, &params(&json!({"compute": 25}))),
    ]));
    let first = decide_claim(&object, ClaimResource::Claim, DRIVER);
    let patched = apply(&object, &first);
    // Deciding again gives the same patch (the webhook always rewrites kerf's configs: it
    // cannot see the stored bytes), and applying it again changes nothing.
    let second = decide_claim(&patched, ClaimResource::Claim, DRIVER);
    assert_eq!(first, second);
    assert_eq!(apply(&patched, &second), patched);
    let ClaimDecision::Normalize { patch, configs } = first else {
        unreachable!()
    };
    assert_eq!(configs, 2);
    // The other driver's config (index 1) is not touched.
    assert!(patch.contains("/config/0/") && patch.contains("/config/2/"));
    assert!(!patch.contains("/config/1/"), "{patch}");
}

#[test]
fn templates_are_patched_at_their_own_path() {
    let object = template(&json!([opaque(DRIVER, &params(&json!({"memory": "1Gi"})))]));
    let decision = decide_claim(&object, ClaimResource::Template, DRIVER);
    let patched = apply(&object, &decision);
    assert_eq!(
        canonical(&patched["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]),
        r#"{"apiVersion":"gpu.kerf.dev/v1alpha1","kind":"GpuClaimParameters","memory":"1Gi"}"#
    );
    // A template's configs are not at the claim's path.
    assert_eq!(
        decide_claim(&object, ClaimResource::Claim, DRIVER),
        ClaimDecision::NoKerfConfig
    );
}

#[test]
fn invalid_parameters_are_denied_naming_field_and_value() {
    let cases = [
        (
            json!({"memory": "-1Gi"}),
            "spec.devices.config[1].opaque.parameters.memory",
            "\"-1Gi\"",
        ),
        (
            json!({"compute": 150}),
            "spec.devices.config[1].opaque.parameters.compute",
            "150 is out of range 1-100",
        ),
        (
            json!({"colour": "red"}),
            "spec.devices.config[1].opaque.parameters.colour",
            "unknown field `colour`",
        ),
    ];
    for (fields, field, value) in cases {
        let object = claim(&json!([
            opaque("other.example.com", &json!({"anything": true})),
            opaque(DRIVER, &params(&fields)),
        ]));
        let (got_field, message) = invalid(decide_claim(&object, ClaimResource::Claim, DRIVER));
        assert_eq!(got_field, field);
        assert!(message.contains(value), "{message}");
    }
    let class = json!({"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClassParameters"});
    let object = template(&json!([opaque(DRIVER, &class)]));
    let (field, message) = invalid(decide_claim(&object, ClaimResource::Template, DRIVER));
    assert_eq!(field, "spec.spec.devices.config[0].opaque.parameters.kind");
    assert!(
        message.contains("GpuClassParameters does not belong in a ResourceClaim"),
        "{message}"
    );
}

#[test]
fn parameters_that_are_not_an_object_are_denied() {
    for parameters in [json!("text"), json!([1, 2]), json!(7), Value::Null] {
        let object = claim(&json!([opaque(DRIVER, &parameters)]));
        let (field, message) = invalid(decide_claim(&object, ClaimResource::Claim, DRIVER));
        assert_eq!(field, "spec.devices.config[0].opaque.parameters");
        assert!(message.contains("expected an object"), "{message}");
    }
    // No parameters at all: the same.
    let object = claim(&json!([{"opaque": {"driver": DRIVER}}]));
    assert!(matches!(
        decide_claim(&object, ClaimResource::Claim, DRIVER),
        ClaimDecision::Invalid { .. }
    ));
}

#[test]
fn objects_without_kerf_configs_are_left_alone() {
    for object in [
        claim(&json!([opaque("other.example.com", &json!({"x": 1}))])),
        claim(&json!([{"requests": ["gpu"]}])),
        claim(&json!([])),
        claim(&json!("not a list")),
        json!({"spec": {"devices": {"requests": []}}}),
        json!({"spec": {}}),
        json!({}),
        json!(null),
        json!([1, 2, 3]),
    ] {
        assert_eq!(
            decide_claim(&object, ClaimResource::Claim, DRIVER),
            ClaimDecision::NoKerfConfig,
            "{object}"
        );
    }
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    /// Whatever sits in the parameters (or in place of the config list), the decision does
    /// not panic, and a patch it gives applies and is a fixed point.
    #[test]
    fn hostile_input_never_panics(parameters in arbitrary_json(), configs in arbitrary_json()) {
        let object = claim(&json!([opaque(DRIVER, &parameters)]));
        let decision = decide_claim(&object, ClaimResource::Claim, DRIVER);
        if matches!(decision, ClaimDecision::Normalize { .. }) {
            let patched = apply(&object, &decision);
            prop_assert_eq!(decide_claim(&patched, ClaimResource::Claim, DRIVER), decision);
        }
        let _ = decide_claim(&claim(&configs), ClaimResource::Claim, DRIVER);
        let _ = canonical(&parameters);
    }
}
