//! Authorization checks kube-apiserver makes on a write after the request itself was
//! authorized, once the old and the new object are known:
//!
//! - a server-side apply (a `patch`) that creates the object also needs `create` on it
//!   (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go`,
//!   the create validation wrapped in `withAuthorization` of `handlers/rest.go`, with the
//!   object's name in the attributes; a denial is `apierrors.NewForbidden(group resource,
//!   name, reason)`);
//! - from Kubernetes 1.36 (DRAResourceClaimGranularStatusAuthorization, beta, on by default)
//!   a write of a ResourceClaim's status is checked per field by the status strategy's
//!   `ValidateUpdate` (`pkg/registry/resource/resourceclaim/strategy.go`) with
//!   `pkg/registry/resource/utils.go`:
//!   - `AuthorizedForBinding`: a change of `status.allocation` or `status.reservedFor` needs
//!     the request's verb on `resourceclaims/binding`, cluster-wide and for all names;
//!   - `AuthorizedForDeviceStatus`: each driver whose `status.devices` entries were added,
//!     removed or changed (`getModifiedDrivers`, entries keyed by driver, pool, device and
//!     share ID) needs `resourceclaims/driver` named after the driver, in the claim's
//!     namespace, with the verb `associated-node:<verb>` or `arbitrary-node:<verb>`; the first
//!     is tried only for a ServiceAccount whose token names exactly one node
//!     (`saAssociatedWithAllocatedNode`) and that node is the one the new allocation pins with
//!     a single `matchFields metadata.name In [<node>]` term (`nodeNameFromAllocation`).
//!
//!   Denials are `field.Forbidden` errors, so the answer is `422 Invalid`
//!   (`apierrors.NewInvalid`), not 403.

use serde_json::Value;

use super::super::routing::ApiRequest;
use super::super::{ApiError, ApiResult, Identity, NODE_NAME_EXTRA, ObjKey};
use super::{Attributes, new_forbidden};

impl ApiRequest {
    /// The checks above for a write of `key` from `old` (`None`: it creates) to `new`.
    ///
    /// # Errors
    /// `403` when an apply may not create, `422` when a ResourceClaim status write changes
    /// fields the user may not change.
    pub(in super::super) fn authorize_write(
        &self,
        key: &ObjKey,
        old: Option<&Value>,
        new: &Value,
    ) -> ApiResult<()> {
        if self
            .user
            .groups
            .iter()
            .any(|g| g == super::PRIVILEGED_GROUP)
        {
            return Ok(());
        }
        let Some(old) = old else {
            return self.authorize_create_on_patch(key);
        };
        let claim_status = self.parsed.status
            && key.resource == "resourceclaims"
            && key.prefix.starts_with("apis/resource.k8s.io/");
        if !claim_status {
            return Ok(());
        }
        let old_status = old.get("status").unwrap_or(&Value::Null);
        let new_status = new.get("status").unwrap_or(&Value::Null);
        let mut errors: Vec<String> = self
            .authorized_for_binding(old_status, new_status)
            .into_iter()
            .collect();
        errors.extend(self.authorized_for_device_status(old_status, new_status));
        if errors.is_empty() {
            return Ok(());
        }
        let aggregate = if errors.len() == 1 {
            errors.swap_remove(0)
        } else {
            format!("[{}]", errors.join(", "))
        };
        Err(ApiError::new(
            422,
            format!(
                "ResourceClaim.resource.k8s.io {:?} is invalid: {aggregate}",
                key.name
            ),
        ))
    }

    /// A `patch` that creates (server-side apply) needs `create` too.
    fn authorize_create_on_patch(&self, key: &ObjKey) -> ApiResult<()> {
        if self.attributes.verb != "patch" {
            return Ok(());
        }
        let attributes = Attributes {
            verb: "create".to_owned(),
            name: key.name.clone(),
            ..self.attributes.clone()
        };
        match self.rbac.authorize(&self.user, &attributes) {
            Ok(()) => Ok(()),
            Err(err) if err.code == 403 => Err(ApiError::new(403, new_forbidden(&attributes, ""))),
            Err(err) => Err(err),
        }
    }

    /// `AuthorizedForBinding`: the field error, if any.
    fn authorized_for_binding(&self, old: &Value, new: &Value) -> Option<String> {
        let unchanged = |field: &str| {
            semantic(old.get(field).unwrap_or(&Value::Null))
                == semantic(new.get(field).unwrap_or(&Value::Null))
        };
        if unchanged("allocation") && unchanged("reservedFor") {
            return None;
        }
        let attributes = Attributes {
            subresource: "binding".to_owned(),
            namespace: String::new(),
            name: String::new(),
            ..self.attributes.clone()
        };
        let err = self.rbac.authorize(&self.user, &attributes).err()?;
        Some(format!(
            "status: Forbidden: changing status.allocation or status.reservedFor requires resource=\"resourceclaims/binding\", verb={:?} permission: {}",
            attributes.verb, err.message
        ))
    }

    /// `AuthorizedForDeviceStatus`: one field error per driver not allowed.
    fn authorized_for_device_status(&self, old: &Value, new: &Value) -> Vec<String> {
        let drivers = modified_drivers(old, new);
        if drivers.is_empty() {
            return Vec::new();
        }
        let verb = &self.attributes.verb;
        let mut verbs = Vec::new();
        if associated_with_allocated_node(&self.user, node_of_allocation(new)) {
            verbs.push(format!("associated-node:{verb}"));
        }
        verbs.push(format!("arbitrary-node:{verb}"));
        let mut errors = Vec::new();
        for driver in drivers {
            let mut first_err = None;
            for verb in &verbs {
                let attributes = Attributes {
                    verb: verb.clone(),
                    subresource: "driver".to_owned(),
                    name: driver.clone(),
                    ..self.attributes.clone()
                };
                match self.rbac.authorize(&self.user, &attributes) {
                    Ok(()) => {
                        first_err = None;
                        break;
                    }
                    Err(err) => {
                        first_err.get_or_insert(err.message);
                    }
                }
            }
            if let Some(err) = first_err {
                errors.push(format!(
                    "status.devices: Forbidden: changing status.devices requires resource=\"resourceclaims/driver\", verb=\"[{}]\" permission: {err}",
                    verbs.join(" ")
                ));
            }
        }
        errors
    }
}

/// `equality.Semantic.DeepEqual` treats a nil and an empty slice alike; JSON's `null`, a
/// missing field and `[]` are all "none" here.
fn semantic(value: &Value) -> &Value {
    match value {
        Value::Array(items) if items.is_empty() => &Value::Null,
        other => other,
    }
}

/// `getModifiedDrivers`: the drivers (sorted, each once) whose `devices` entries were added,
/// removed or changed.
fn modified_drivers(old: &Value, new: &Value) -> Vec<String> {
    let entries = |status: &Value| -> Vec<Value> {
        status
            .get("devices")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let key = |entry: &Value| {
        ["driver", "pool", "device", "shareID"].map(|field| {
            entry
                .get(field)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        })
    };
    let mut old_entries = entries(old);
    let mut drivers = Vec::new();
    for entry in entries(new) {
        let position = old_entries.iter().position(|o| key(o) == key(&entry));
        let unchanged = position.is_some_and(|i| old_entries.swap_remove(i) == entry);
        if !unchanged {
            drivers.push(key(&entry)[0].clone());
        }
    }
    drivers.extend(old_entries.iter().map(|entry| key(entry)[0].clone()));
    drivers.sort();
    drivers.dedup();
    drivers
}

/// `nodeNameFromAllocation`: the node a new allocation pins with exactly one node selector
/// term of exactly one `matchFields` requirement `metadata.name In [<node>]` and no
/// `matchExpressions`.
fn node_of_allocation(status: &Value) -> Option<&str> {
    let terms = status
        .pointer("/allocation/nodeSelector/nodeSelectorTerms")?
        .as_array()?;
    let [term] = terms.as_slice() else {
        return None;
    };
    let expressions = term
        .get("matchExpressions")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let fields = term.get("matchFields")?.as_array()?;
    let ([field], 0) = (fields.as_slice(), expressions) else {
        return None;
    };
    let values = field.get("values")?.as_array()?;
    let (Some("metadata.name"), Some("In"), [value]) = (
        field.get("key").and_then(Value::as_str),
        field.get("operator").and_then(Value::as_str),
        values.as_slice(),
    ) else {
        return None;
    };
    value.as_str()
}

/// `saAssociatedWithAllocatedNode`: a ServiceAccount (`system:serviceaccount:<ns>:<name>`)
/// whose token carries exactly one node name, a valid one, equal to `allocated`.
fn associated_with_allocated_node(user: &Identity, allocated: Option<&str>) -> bool {
    let Some(allocated) = allocated.filter(|n| !n.is_empty()) else {
        return false;
    };
    let service_account = user
        .username
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
        .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains(':'));
    let nodes = user.extra.get(NODE_NAME_EXTRA).map(Vec::as_slice);
    let Some([node]) = nodes else {
        return false;
    };
    service_account && is_dns_subdomain(node) && node == allocated
}

/// `ValidateNodeName`: a DNS-1123 subdomain.
fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}
