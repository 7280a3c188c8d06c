//! Validation kube-apiserver applies to every update, and the `Invalid` (422) errors it
//! answers with.
//!
//! - `apierrors.NewInvalid` (kubernetes/kubernetes
//!   `staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go`): message
//!   `<Kind>[.<group>] "<name>" is invalid: <field errors, joined by ", ">`, and a `details`
//!   with group, kind, name and one cause per field error (`reason` = the error type,
//!   `message` = `field.Error.ErrorBody()`, `field`).
//! - `ValidateObjectMetaUpdate` (`staging/src/k8s.io/apimachinery/pkg/api/validation/
//!   objectmeta.go`): once an object is being deleted, no finalizer may be added
//!   (`ValidateNoNewFinalizers`); `rest.BeforeUpdate`
//!   (`staging/src/k8s.io/apiserver/pkg/registry/rest/update.go`) keeps the old UID when the
//!   update names none, and a different one is `metadata.uid: … field is immutable`.

use serde_json::{Value, json};

use super::store::str_at;
use super::{ApiError, ObjKey};

/// The API group of the objects at `key` (empty for the core group).
pub(super) fn group_of(key: &ObjKey) -> String {
    key.prefix
        .strip_prefix("apis/")
        .and_then(|gv| gv.split('/').next())
        .unwrap_or("")
        .to_owned()
}

/// One `field.Error`: its type (`FieldValueInvalid`, …), field path and `ErrorBody()`.
#[derive(Debug, Clone)]
pub(super) struct FieldError {
    /// `field.ErrorType`, e.g. `FieldValueInvalid`; the cause's `reason`.
    pub(super) error_type: &'static str,
    /// The field path, e.g. `spec`.
    pub(super) field: String,
    /// `ErrorBody()`, e.g. `Invalid value: "x": field is immutable`.
    pub(super) body: String,
}

impl FieldError {
    /// `field.Invalid(path, value, detail)` with the value already rendered as Go prints it.
    pub(super) fn invalid(field: &str, value: &str, detail: &str) -> Self {
        Self {
            error_type: "FieldValueInvalid",
            field: field.to_owned(),
            body: format!("Invalid value: {value}: {detail}"),
        }
    }

    /// `field.Forbidden(path, detail)`.
    pub(super) fn forbidden(field: &str, detail: &str) -> Self {
        Self {
            error_type: "FieldValueForbidden",
            field: field.to_owned(),
            body: format!("Forbidden: {detail}"),
        }
    }

    /// `field.Required(path, detail)`.
    pub(super) fn required(field: &str, detail: &str) -> Self {
        Self {
            error_type: "FieldValueRequired",
            field: field.to_owned(),
            body: format!("Required value: {detail}"),
        }
    }
}

/// `apierrors.NewInvalid(schema.GroupKind{group, kind}, name, errors)`.
pub(super) fn invalid(group: &str, kind: &str, name: &str, errors: &[FieldError]) -> ApiError {
    let qualified = if group.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}.{group}")
    };
    let joined: Vec<String> = errors
        .iter()
        .map(|e| format!("{}: {}", e.field, e.body))
        .collect();
    let message = match joined.len() {
        0 => format!("{qualified} {name:?} is invalid"),
        // utilerrors.NewAggregate prints one error as it is and several as a list.
        1 => format!("{qualified} {name:?} is invalid: {}", joined[0]),
        _ => format!("{qualified} {name:?} is invalid: [{}]", joined.join(", ")),
    };
    let causes: Vec<Value> = errors
        .iter()
        .map(|e| json!({"reason": e.error_type, "message": e.body, "field": e.field}))
        .collect();
    let mut details = json!({"name": name, "kind": kind, "causes": causes});
    if !group.is_empty() {
        details["group"] = json!(group);
    }
    let mut err = ApiError::new(422, message);
    err.details = Some(details);
    err
}

/// Go's `%#v` of a `[]string`, as `ValidateNoNewFinalizers` prints the new finalizers.
fn go_string_slice(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("{s:?}")).collect();
    format!("[]string{{{}}}", quoted.join(", "))
}

fn finalizers(obj: &Value) -> Vec<&str> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|items| items.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The `ValidateObjectMetaUpdate` errors of updating `current` to `next`: finalizers added
/// while the object is being deleted, and a changed UID.
pub(super) fn object_meta_update_errors(current: &Value, next: &Value) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let deleting = current
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null());
    if deleting {
        let old = finalizers(current);
        let mut added: Vec<&str> = finalizers(next)
            .into_iter()
            .filter(|f| !old.contains(f))
            .collect();
        // sets.List: sorted, without duplicates.
        added.sort_unstable();
        added.dedup();
        if !added.is_empty() {
            errors.push(FieldError::forbidden(
                "metadata.finalizers",
                &format!(
                    "no new finalizers can be added if the object is being deleted, found new finalizers {}",
                    go_string_slice(&added)
                ),
            ));
        }
    }
    let new_uid = str_at(next, "/metadata/uid");
    let old_uid = str_at(current, "/metadata/uid");
    if !new_uid.is_empty() && new_uid != old_uid {
        errors.push(FieldError::invalid(
            "metadata.uid",
            &format!("{new_uid:?}"),
            "field is immutable",
        ));
    }
    errors
}
