//! ValidatingAdmissionPolicies, evaluated as kube-apiserver's `validating` policy plugin
//! evaluates them (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating/`: `dispatcher.go`,
//! `validator.go`), with the [`cel`] crate.
//!
//! The fake loads the policies and bindings kerf ships ([`KERF_POLICY_MANIFESTS`]: the
//! kubelet plugin's ResourceSlices and its MPS daemon pods). For a request a policy's
//! `matchConstraints.resourceRules` match (main resource only; no policy kerf ships names a
//! subresource), it evaluates
//! - `matchConditions` in order: one that is false makes the policy not apply;
//! - `variables` in order, each seeing the ones before it as `variables.<name>`;
//! - `validations` in order: the first that is false denies with its `messageExpression`
//!   (when that yields a non-empty string), else its `message`, else
//!   `failed expression: <expression>`,
//!
//! with the activation upstream builds: `object` (null on DELETE), `oldObject` (null on
//! CREATE), `request` (`operation`, `name`, `namespace`, `userInfo.username`/`groups`/
//! `extra`, `resource`, `subResource`, `dryRun`), `params` and `namespaceObject` (null).
//! An evaluation error denies (`failurePolicy: Fail`) or skips the policy (`Ignore`).
//!
//! Every policy that matches is evaluated, in the order of the manifests; as upstream's
//! `dispatcher.Dispatch` collects the denied decisions of all of them and reports the first,
//! the fake stops at the first denial, which is the same one.
//!
//! A denial is what the dispatcher returns: `admission.NewForbidden` (`<resource>.<group>
//! "<name>" is forbidden: ValidatingAdmissionPolicy '<policy>' with binding '<binding>'
//! denied request: <message>`) with reason `Invalid` and code 422 (or the validation's
//! `reason`), and the message as a cause.
//!
//! Not modelled, as kerf's policy uses none of it: `paramKind`/`paramRef`,
//! `namespaceSelector`/`objectSelector`, a binding's `matchResources`, `auditAnnotations`,
//! the `Warn`/`Audit` actions (only `Deny` denies), CEL cost limits and type checking at load
//! time (an expression that would not type-check upstream fails here only when evaluated).

use std::collections::HashMap;
use std::sync::Arc;

use cel::{Context, Env, Value as CelValue};
use serde_json::{Value, json};

use super::identity::Identity;
use super::meta_rules::group_of;
use super::{ApiError, ApiResult, ObjKey, qualified_resource};

/// The manifests of the policies kerf ships (the chart's default install), so that the fake
/// cannot drift from them.
const KERF_POLICY_MANIFESTS: [(&str, &str); 1] =
    [(crate::manifests::INSTALL_PATH, crate::manifests::INSTALL)];

/// One ValidatingAdmissionPolicy and the binding that puts it in force with `Deny`.
#[derive(Debug, Clone)]
struct BoundPolicy {
    name: String,
    binding: String,
    fail_closed: bool,
    spec: Value,
}

/// The policies in force, or why they could not be loaded (every request they might apply
/// to then fails with 500, so a broken manifest cannot go unnoticed).
pub(super) struct Policies {
    loaded: Result<Vec<BoundPolicy>, String>,
    env: Arc<Env>,
}

impl Policies {
    /// The policies and bindings of [`KERF_POLICY_MANIFESTS`].
    pub(super) fn kerf() -> Self {
        Self::from_files(&KERF_POLICY_MANIFESTS)
    }

    /// The bound policies of a multi-document YAML manifest.
    #[cfg(test)]
    pub(super) fn from_manifests(text: &str) -> Self {
        Self::from_files(&[("policy manifest", text)])
    }

    /// The bound policies of several multi-document YAML manifests, each named by its path;
    /// a binding may name a policy of any of them, as in a cluster where all are applied.
    fn from_files(files: &[(&str, &str)]) -> Self {
        let env = Arc::new(Env::stdlib());
        let loaded = files
            .iter()
            .map(|(path, text)| {
                serde_saphyr::from_multiple::<Value>(text)
                    .map_err(|e| format!("{path} is not YAML: {e}"))
            })
            .collect::<Result<Vec<Vec<Value>>, String>>()
            .and_then(|docs| bind(&docs.concat(), &env));
        Self { loaded, env }
    }

    /// Why the policies could not be loaded, if they could not.
    #[cfg(test)]
    pub(super) fn load_error(&self) -> Option<&str> {
        self.loaded.as_ref().err().map(String::as_str)
    }

    /// Runs the policies that match `operation` on the object at `key`.
    ///
    /// # Errors
    ///
    /// The denial of the first policy that denies, as kube-apiserver words it; 500 when the
    /// policies could not be loaded.
    pub(super) fn validate(
        &self,
        user: &Identity,
        operation: &str,
        key: &ObjKey,
        old: Option<&Value>,
        new: Option<&Value>,
    ) -> ApiResult<()> {
        let policies = match &self.loaded {
            Ok(policies) => policies,
            Err(why) => return Err(ApiError::new(500, why.clone())),
        };
        for policy in policies {
            if !rules_match(&policy.spec, operation, key) {
                continue;
            }
            let activation = Activation {
                request: request_json(user, operation, key),
                object: new.cloned().unwrap_or(Value::Null),
                old_object: old.cloned().unwrap_or(Value::Null),
            };
            if let Some(message) = self.evaluate(policy, &activation) {
                return Err(denial(policy, key, &message));
            }
        }
        Ok(())
    }

    /// The denial message of `policy` for this request, if it denies.
    fn evaluate(&self, policy: &BoundPolicy, activation: &Activation) -> Option<String> {
        let mut context = Context::with_env(Arc::clone(&self.env));
        for (name, value) in [
            ("request", &activation.request),
            ("object", &activation.object),
            ("oldObject", &activation.old_object),
        ] {
            context.add_variable_from_value(name, to_cel(value));
        }
        context.add_variable_from_value("params", CelValue::Null);
        context.add_variable_from_value("namespaceObject", CelValue::Null);
        let on_error = |message: String| policy.fail_closed.then_some(message);
        for condition in items(&policy.spec, "matchConditions") {
            let expression = str_of(condition, "expression");
            match self.run(&context, expression) {
                Ok(CelValue::Bool(true)) => {}
                Ok(CelValue::Bool(false)) => return None,
                Ok(other) => return on_error(not_bool(expression, &other)),
                Err(e) => return on_error(e),
            }
        }
        let mut variables: HashMap<String, CelValue> = HashMap::new();
        for variable in items(&policy.spec, "variables") {
            context.add_variable_from_value("variables", variables.clone());
            // A variable that fails is left out: an expression that uses it fails then.
            if let Ok(value) = self.run(&context, str_of(variable, "expression")) {
                variables.insert(str_of(variable, "name").to_owned(), value);
            }
        }
        context.add_variable_from_value("variables", variables);
        for validation in items(&policy.spec, "validations") {
            let expression = str_of(validation, "expression");
            match self.run(&context, expression) {
                Ok(CelValue::Bool(true)) => {}
                Ok(CelValue::Bool(false)) => return Some(self.message(&context, validation)),
                Ok(other) => return on_error(not_bool(expression, &other)),
                Err(e) => return on_error(e),
            }
        }
        None
    }

    /// `validator.go`: the messageExpression's string when it yields a non-empty one without
    /// line breaks (trimmed), else `message`, else `failed expression: <expression>`.
    fn message(&self, context: &Context<'_, '_>, validation: &Value) -> String {
        let from_expression = validation
            .get("messageExpression")
            .and_then(Value::as_str)
            .and_then(|e| self.run(context, e).ok())
            .and_then(|v| match v {
                CelValue::String(s) => Some(s.trim().to_owned()),
                _ => None,
            })
            .filter(|s| !s.is_empty() && !s.contains('\n'));
        from_expression
            .or_else(|| {
                validation
                    .get("message")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| {
                format!(
                    "failed expression: {}",
                    str_of(validation, "expression").trim()
                )
            })
    }

    fn run(&self, context: &Context<'_, '_>, expression: &str) -> Result<CelValue, String> {
        let program = self
            .env
            .compile(expression)
            .map_err(|e| format!("compilation failed: {e}"))?;
        program
            .execute(context)
            .map_err(|e| format!("expression '{}' resulted in error: {e}", expression.trim()))
    }
}

/// The variables a policy's expressions see, as JSON.
struct Activation {
    request: Value,
    object: Value,
    old_object: Value,
}

/// The binding of each policy in `docs` that denies, with the policy's expressions checked
/// for syntax.
fn bind(docs: &[Value], env: &Env) -> Result<Vec<BoundPolicy>, String> {
    let of_kind = |kind: &'static str| {
        docs.iter()
            .filter(move |d| d.get("kind").and_then(Value::as_str) == Some(kind))
    };
    let mut bound = Vec::new();
    for binding in of_kind("ValidatingAdmissionPolicyBinding") {
        let actions = binding
            .pointer("/spec/validationActions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if !actions.iter().any(|a| a.as_str() == Some("Deny")) {
            continue;
        }
        let policy_name = binding
            .pointer("/spec/policyName")
            .and_then(Value::as_str)
            .unwrap_or("");
        let Some(policy) = of_kind("ValidatingAdmissionPolicy")
            .find(|p| p.pointer("/metadata/name").and_then(Value::as_str) == Some(policy_name))
        else {
            return Err(format!("binding of unknown policy {policy_name:?}"));
        };
        let spec = policy.get("spec").cloned().unwrap_or(Value::Null);
        for section in ["matchConditions", "variables", "validations"] {
            for item in items(&spec, section) {
                for field in ["expression", "messageExpression"] {
                    if let Some(expression) = item.get(field).and_then(Value::as_str) {
                        env.compile(expression)
                            .map_err(|e| format!("{policy_name}: {section} {expression:?}: {e}"))?;
                    }
                }
            }
        }
        bound.push(BoundPolicy {
            name: policy_name.to_owned(),
            binding: str_of(binding, "/metadata/name").to_owned(),
            fail_closed: spec.get("failurePolicy").and_then(Value::as_str) != Some("Ignore"),
            spec,
        });
    }
    Ok(bound)
}

fn items<'a>(spec: &'a Value, section: &str) -> impl Iterator<Item = &'a Value> {
    spec.get(section)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// The string at `field` (a key, or a pointer when it starts with `/`), or "".
fn str_of<'a>(value: &'a Value, field: &str) -> &'a str {
    let found = if field.starts_with('/') {
        value.pointer(field)
    } else {
        value.get(field)
    };
    found.and_then(Value::as_str).unwrap_or("")
}

fn not_bool(expression: &str, value: &CelValue) -> String {
    format!(
        "expression '{}' resulted in error: expected a bool, got {:?}",
        expression.trim(),
        value.type_of()
    )
}

fn to_cel(value: &Value) -> CelValue {
    // serde_json values always serialize into CEL values.
    cel::to_value(value).unwrap_or(CelValue::Null)
}

/// Whether a policy's `matchConstraints.resourceRules` match the request.
fn rules_match(spec: &Value, operation: &str, key: &ObjKey) -> bool {
    let group = group_of(key);
    let version = key.prefix.rsplit('/').next().unwrap_or("");
    let has = |rule: &Value, field: &str, wanted: &str| {
        rule.get(field).and_then(Value::as_array).is_some_and(|xs| {
            xs.iter()
                .any(|x| matches!(x.as_str(), Some(s) if s == "*" || s == wanted))
        })
    };
    spec.pointer("/matchConstraints/resourceRules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|rule| {
            has(rule, "apiGroups", &group)
                && has(rule, "apiVersions", version)
                && has(rule, "operations", operation)
                && has(rule, "resources", &key.resource)
        })
}

/// The `request` variable (an `admissionv1.AdmissionRequest` as CEL sees it).
fn request_json(user: &Identity, operation: &str, key: &ObjKey) -> Value {
    let group = group_of(key);
    let version = key.prefix.rsplit('/').next().unwrap_or("");
    json!({
        "operation": operation,
        "name": key.name,
        "namespace": key.namespace,
        "resource": {"group": group, "version": version, "resource": key.resource},
        "subResource": "",
        "dryRun": false,
        "userInfo": {
            "username": user.username,
            "uid": "",
            "groups": user.groups,
            "extra": user.extra,
        },
    })
}

/// The dispatcher's error for a denial (`admission.NewForbidden`, reason set to `Invalid`).
fn denial(policy: &BoundPolicy, key: &ObjKey, message: &str) -> ApiError {
    let message = format!(
        "ValidatingAdmissionPolicy '{}' with binding '{}' denied request: {message}",
        policy.name, policy.binding
    );
    let full = format!(
        "{} {:?} is forbidden: {message}",
        qualified_resource(key),
        key.name
    );
    let mut err = ApiError::new(422, full);
    err.details = Some(json!({
        "name": key.name,
        "group": group_of(key),
        "kind": key.resource,
        "causes": [{"message": message}],
    }));
    err
}
