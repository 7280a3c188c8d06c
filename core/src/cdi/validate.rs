//! The CDI naming and content rules that the upstream JSON schema does not express.
//!
//! The rules follow the reference implementation's parser (vendor, class and device names)
//! and its edit validation, plus two checks of kerf's own: environment variable names must be
//! portable (`[A-Za-z_][A-Za-z0-9_]*`) and container paths absolute.

use std::collections::BTreeSet;

use super::spec::{ContainerEdits, DeviceNode, Hook, Mount, Spec};
use crate::error::{Error, Result};

/// OCI hook points a CDI hook may name.
const HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

impl Spec {
    /// Checks the spec against the CDI naming rules and kerf's content rules: the kind, every
    /// device name (non-empty, unique), every env entry, device node, mount and hook, and
    /// that `cdiVersion` is at least [`Spec::minimum_version`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCdiSpec`] naming the first offending value.
    pub fn validate(&self) -> Result<()> {
        validate_kind(&self.kind)?;
        if self.devices.is_empty() {
            return Err(invalid(format!(
                "spec of kind {:?} defines no devices",
                self.kind
            )));
        }
        let mut seen = BTreeSet::new();
        for device in &self.devices {
            validate_device_name(&device.name)?;
            if !seen.insert(device.name.as_str()) {
                return Err(invalid(format!(
                    "device name {:?} appears more than once",
                    device.name
                )));
            }
            validate_annotations(&device.annotations, &device.name)?;
            validate_edits(&device.container_edits)
                .map_err(|e| invalid(format!("device {:?}: {}", device.name, message(e))))?;
        }
        validate_annotations(&self.annotations, "spec")?;
        validate_edits(&self.container_edits)
            .map_err(|e| invalid(format!("spec containerEdits: {}", message(e))))?;
        let needed = self.minimum_version();
        if self.cdi_version < needed {
            return Err(invalid(format!(
                "cdiVersion {} is lower than the {needed} its fields need",
                self.cdi_version
            )));
        }
        Ok(())
    }
}

/// Splits and checks a `vendor/class` kind.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] when the kind has no `/` or either part breaks the naming rules.
pub fn parse_kind(kind: &str) -> Result<(&str, &str)> {
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| invalid(format!("kind {kind:?} is not of the form vendor/class")))?;
    validate_qualifier_part("vendor", vendor, kind)?;
    validate_qualifier_part("class", class, kind)?;
    Ok((vendor, class))
}

/// Checks a `vendor/class` kind.
///
/// # Errors
///
/// See [`parse_kind`].
pub fn validate_kind(kind: &str) -> Result<()> {
    parse_kind(kind).map(|_| ())
}

/// Checks a device name: starts and ends with a letter or digit, and uses only letters,
/// digits, `_`, `.`, `:` and `-` in between. (A leading digit needs CDI 0.5.0; that is a
/// version question, not a naming error.)
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] naming the device name and the rule it breaks.
pub fn validate_device_name(name: &str) -> Result<()> {
    let bytes = name.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return Err(invalid("device name is empty".to_owned()));
    };
    if !first.is_ascii_alphanumeric() {
        return Err(invalid(format!(
            "device name {name:?} must start with a letter or digit"
        )));
    }
    if !last.is_ascii_alphanumeric() {
        return Err(invalid(format!(
            "device name {name:?} must end with a letter or digit"
        )));
    }
    if let Some(bad) = name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
    {
        return Err(invalid(format!(
            "device name {name:?} contains {bad:?}; allowed are letters, digits, _ . : -"
        )));
    }
    Ok(())
}

/// Checks one `NAME=value` environment entry; the name must be a portable variable name.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] naming the entry.
pub fn validate_env(entry: &str) -> Result<()> {
    let Some((name, value)) = entry.split_once('=') else {
        return Err(invalid(format!(
            "env entry {entry:?} is not of the form NAME=value"
        )));
    };
    let mut chars = name.chars();
    let portable = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !portable {
        return Err(invalid(format!(
            "env entry {entry:?}: {name:?} is not a valid variable name"
        )));
    }
    if value.contains('\0') {
        return Err(invalid(format!("env entry {entry:?} contains a NUL byte")));
    }
    Ok(())
}

fn validate_qualifier_part(what: &str, part: &str, kind: &str) -> Result<()> {
    let bytes = part.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return Err(invalid(format!("kind {kind:?}: {what} is empty")));
    };
    if !first.is_ascii_alphabetic() {
        return Err(invalid(format!(
            "kind {kind:?}: {what} {part:?} must start with a letter"
        )));
    }
    if !last.is_ascii_alphanumeric() {
        return Err(invalid(format!(
            "kind {kind:?}: {what} {part:?} must end with a letter or digit"
        )));
    }
    if let Some(bad) = part
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(invalid(format!(
            "kind {kind:?}: {what} {part:?} contains {bad:?}; allowed are letters, digits, _ . -"
        )));
    }
    Ok(())
}

fn validate_annotations(
    annotations: &std::collections::BTreeMap<String, String>,
    owner: &str,
) -> Result<()> {
    match annotations.keys().find(|k| k.is_empty()) {
        Some(_) => Err(invalid(format!("{owner}: annotation with an empty key"))),
        None => Ok(()),
    }
}

fn validate_edits(edits: &ContainerEdits) -> Result<()> {
    edits.env.iter().try_for_each(|e| validate_env(e))?;
    edits
        .device_nodes
        .iter()
        .try_for_each(validate_device_node)?;
    edits.mounts.iter().try_for_each(validate_mount)?;
    edits.hooks.iter().try_for_each(validate_hook)
}

fn validate_device_node(node: &DeviceNode) -> Result<()> {
    require_absolute("deviceNodes[].path", &node.path)?;
    if let Some(host) = &node.host_path {
        require_absolute("deviceNodes[].hostPath", host)?;
    }
    if let Some(t) = node
        .node_type
        .as_deref()
        .filter(|t| !["b", "c", "u", "p"].contains(t))
    {
        return Err(invalid(format!(
            "device node {:?}: type {t:?} is not one of b, c, u, p",
            node.path
        )));
    }
    if let Some(p) = node
        .permissions
        .as_deref()
        .filter(|p| p.chars().any(|c| !matches!(c, 'r' | 'w' | 'm')))
    {
        return Err(invalid(format!(
            "device node {:?}: permissions {p:?} may only combine r, w, m",
            node.path
        )));
    }
    Ok(())
}

fn validate_mount(mount: &Mount) -> Result<()> {
    if mount.host_path.is_empty() {
        return Err(invalid(format!(
            "mount to {:?} has an empty hostPath",
            mount.container_path
        )));
    }
    require_absolute("mounts[].containerPath", &mount.container_path)
}

fn validate_hook(hook: &Hook) -> Result<()> {
    if !HOOK_NAMES.contains(&hook.hook_name.as_str()) {
        return Err(invalid(format!(
            "hook {:?}: hookName {:?} is not one of {}",
            hook.path,
            hook.hook_name,
            HOOK_NAMES.join(", ")
        )));
    }
    require_absolute("hooks[].path", &hook.path)?;
    hook.env.iter().try_for_each(|e| validate_env(e))
}

fn require_absolute(field: &str, path: &str) -> Result<()> {
    if path.starts_with('/') && !path.contains('\0') {
        Ok(())
    } else {
        Err(invalid(format!("{field} {path:?} is not an absolute path")))
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidCdiSpec(message)
}

/// The message of an [`Error::InvalidCdiSpec`], to prefix it with context.
fn message(e: Error) -> String {
    match e {
        Error::InvalidCdiSpec(m) => m,
        other => other.to_string(),
    }
}
