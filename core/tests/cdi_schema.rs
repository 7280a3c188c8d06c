//! Every spec the generator produces validates against the upstream CDI JSON schema
//! (cncf-tags/container-device-interface at 05ae4b5b, spec 1.1.0, copied verbatim into
//! `tests/data/cdi-schema/`).
//!
//! The upstream schema is loose, so each spec is checked twice:
//! - against the schema **as published**, with `defs.json` registered as a local resource so
//!   that `schema.json`'s `defs.json#/…` references resolve without network access;
//! - against a **strict** copy patched in memory: `additionalProperties: false` on every
//!   object (CDI loaders reject unknown fields, the schema does not), `deviceNodes[].fileMode`
//!   added (the schema forgets it, the Go type has it), and `containerEdits.env.items` fixed.
//!   Upstream writes `"ref": "#definitions/Env"` there, an unknown keyword that accepts
//!   anything; spelling it `$ref` would not help, since `Env` is an array of strings and each
//!   item would then have to be an array. The intended rule is `{"type": "string"}`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

mod common;

use std::path::PathBuf;

use jsonschema::{Registry, Validator};
use serde_json::{Value, json};

const BASE: &str = "file:///cdi-schema/";

fn load(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/cdi-schema")
        .join(name);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn validator(schema: &Value, defs: Value) -> Validator {
    let registry = Registry::new()
        .add(format!("{BASE}defs.json"), defs)
        .unwrap()
        .prepare()
        .unwrap();
    jsonschema::options()
        .with_registry(&registry)
        .with_base_uri(format!("{BASE}schema.json"))
        .build(schema)
        .unwrap()
}

fn upstream() -> Validator {
    validator(&load("schema.json"), load("defs.json"))
}

fn strict() -> Validator {
    let mut schema = load("schema.json");
    schema["additionalProperties"] = json!(false);
    schema["properties"]["devices"]["items"]["additionalProperties"] = json!(false);
    let mut defs = load("defs.json");
    let d = &mut defs["definitions"];
    for object in [
        "DeviceNode",
        "Mount",
        "Hook",
        "LinuxNetDevice",
        "containerEdits",
    ] {
        d[object]["additionalProperties"] = json!(false);
    }
    d["containerEdits"]["properties"]["intelRdt"]["additionalProperties"] = json!(false);
    d["DeviceNode"]["properties"]["fileMode"] = json!({"$ref": "#/definitions/uint32"});
    d["containerEdits"]["properties"]["env"]["items"] = json!({"type": "string"});
    validator(&schema, defs)
}

fn errors(v: &Validator, doc: &Value) -> Vec<String> {
    v.iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

#[test]
fn generated_specs_validate_against_upstream_and_strict_schema() {
    let (upstream, strict) = (upstream(), strict());
    let scenarios = common::scenarios();
    assert!(
        scenarios.len() >= 32,
        "too few scenarios: {}",
        scenarios.len()
    );
    for (name, generated) in scenarios {
        let doc = serde_json::to_value(&generated.spec).unwrap();
        assert_eq!(
            errors(&upstream, &doc),
            Vec::<String>::new(),
            "{name} (upstream schema): {doc}"
        );
        assert_eq!(
            errors(&strict, &doc),
            Vec::<String>::new(),
            "{name} (strict schema): {doc}"
        );
    }
}

#[test]
fn a_spec_with_every_field_validates_against_the_strict_schema() {
    let doc = json!({
        "cdiVersion": "1.1.0",
        "kind": "example.com/dev.x",
        "annotations": {"a": "b"},
        "devices": [{
            "name": "0",
            "annotations": {"c": "d"},
            "containerEdits": {
                "deviceNodes": [{
                    "path": "/dev/x", "hostPath": "/dev/null", "type": "c", "major": 1, "minor": 3,
                    "fileMode": 438, "permissions": "rw", "uid": 0, "gid": 0
                }]
            }
        }],
        "containerEdits": {
            "env": ["A=1"],
            "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro"], "type": "bind"}],
            "hooks": [{"hookName": "createContainer", "path": "/bin/true", "args": ["true"], "env": ["B=2"], "timeout": 5}],
            "additionalGids": [44],
            "intelRdt": {"closID": "c", "l3CacheSchema": "L3:0=f", "memBwSchema": "MB:0=50", "schemata": ["L2:0=3"], "enableMonitoring": true},
            "netDevices": [{"hostInterfaceName": "eth1", "name": "net0"}]
        }
    });
    assert_eq!(errors(&strict(), &doc), Vec::<String>::new());
    // And the typed model reads it back and writes the same document.
    let spec: kerf_core::cdi::Spec = serde_json::from_value(doc.clone()).unwrap();
    spec.validate().unwrap();
    assert_eq!(serde_json::to_value(&spec).unwrap(), doc);
}

/// The validators are not vacuous: they reject what they should.
#[test]
fn schemas_reject_broken_specs() {
    let (upstream, strict) = (upstream(), strict());
    let missing_devices = json!({"cdiVersion": "0.3.0", "kind": "a/b"});
    assert!(!errors(&upstream, &missing_devices).is_empty());
    let bad_node = json!({"cdiVersion": "0.3.0", "kind": "a/b", "devices": [
        {"name": "x", "containerEdits": {"deviceNodes": [{"hostPath": "/dev/null"}]}}
    ]});
    assert!(
        !errors(&upstream, &bad_node).is_empty(),
        "missing deviceNodes[].path must fail via defs.json"
    );
    let unknown_field = json!({"cdiVersion": "0.3.0", "kind": "a/b", "devices": [
        {"name": "x", "containerEdits": {"envs": ["A=1"]}}
    ]});
    assert!(
        errors(&upstream, &unknown_field).is_empty(),
        "the upstream schema is loose"
    );
    assert!(!errors(&strict, &unknown_field).is_empty());
    let numeric_env = json!({"cdiVersion": "0.3.0", "kind": "a/b", "devices": [
        {"name": "x", "containerEdits": {"env": [1]}}
    ]});
    assert!(
        errors(&upstream, &numeric_env).is_empty(),
        "the upstream env items rule is a typo"
    );
    assert!(!errors(&strict, &numeric_env).is_empty());
}
