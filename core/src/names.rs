//! Validation of names that come from outside the process — from the kubelet, the API server or
//! a configuration file — before they are used in file paths, CDI names or Kubernetes names.
//!
//! Every validator has the same shape: `fn(field, value) -> Result<&str>`. `field` names where
//! the value came from (`claim.uid`, `claim.namespace`, `driverName`, …) so that the error says
//! which input was wrong; the validated value is handed back so a call can sit inside an
//! expression. Errors are [`Error::InvalidName`].
//!
//! Before its own rule, every validator rejects what could escape a directory or confuse a path
//! or a C string: the empty string, `/`, `..`, NUL and whitespace. No valid DNS name or UID
//! contains any of them, so this only sharpens the error message.

use crate::error::{Error, Result};

/// Longest claim UID accepted. Kubernetes UIDs are 36 characters; the slack tolerates other
/// UID generators without letting a UID grow into a path-length problem.
const MAX_UID_LEN: usize = 64;
/// Longest DNS-1123 label (RFC 1123).
const MAX_DNS_LABEL_LEN: usize = 63;
/// Longest DNS-1123 subdomain (RFC 1123).
const MAX_DNS_SUBDOMAIN_LEN: usize = 253;
/// Longest DRA driver name (Kubernetes limits `ResourceSlice.spec.driver` to 63 characters).
const MAX_DRIVER_NAME_LEN: usize = 63;
/// Longest GPU UUID accepted (NVML UUIDs are 40 characters).
const MAX_GPU_UUID_LEN: usize = 64;

/// Validates a claim UID: `[a-z0-9-]`, 1 to `MAX_UID_LEN` characters, not starting with `-`.
///
/// Kubernetes writes UIDs in RFC 4122 form (`8-4-4-4-12` lowercase hex); any lowercase
/// alphanumeric-and-dash string is accepted so that test clusters with other UID formats work.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value breaks the rule.
pub fn claim_uid<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    reject_path_hazards(field, value)?;
    check_len(field, value, MAX_UID_LEN, "is longer than 64 characters")?;
    if value.starts_with('-') {
        return Err(invalid(field, value, "must not start with '-'"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(invalid(
            field,
            value,
            "may only contain lowercase letters, digits and '-'",
        ));
    }
    Ok(value)
}

/// Validates a namespace name: a DNS-1123 label.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value is not a DNS-1123 label.
pub fn namespace<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    dns_label(field, value)
}

/// Validates an object name (claim, slice, class, …): a DNS-1123 subdomain.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value is not a DNS-1123 subdomain.
pub fn object_name<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    dns_subdomain(field, value)
}

/// Validates a DNS-1123 label: 1 to 63 characters of `[a-z0-9-]`, starting and ending with a
/// letter or digit.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value breaks the rule.
pub(crate) fn dns_label<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    reject_path_hazards(field, value)?;
    check_len(
        field,
        value,
        MAX_DNS_LABEL_LEN,
        "is longer than 63 characters",
    )?;
    label_rule(value).map_err(|reason| invalid(field, value, reason))?;
    Ok(value)
}

/// Validates a DNS-1123 subdomain: at most 253 characters, one or more DNS-1123 labels joined
/// by `.`.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value breaks the rule.
fn dns_subdomain<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    subdomain_with_limit(
        field,
        value,
        MAX_DNS_SUBDOMAIN_LEN,
        "is longer than 253 characters",
    )
}

/// Validates a DRA driver name: a DNS-1123 subdomain of at most 63 characters, e.g.
/// `gpu.kerf.dev`.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value breaks the rule.
pub fn driver_name<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    subdomain_with_limit(
        field,
        value,
        MAX_DRIVER_NAME_LEN,
        "is longer than 63 characters",
    )
}

fn subdomain_with_limit<'a>(
    field: &'static str,
    value: &'a str,
    max: usize,
    too_long: &'static str,
) -> Result<&'a str> {
    reject_path_hazards(field, value)?;
    check_len(field, value, max, too_long)?;
    for label in value.split('.') {
        // Labels inside a subdomain have no length limit of their own in Kubernetes' check.
        label_rule(label).map_err(|reason| invalid(field, value, reason))?;
    }
    Ok(value)
}

/// The character rule of a DNS-1123 label, without its length limit.
fn label_rule(label: &str) -> std::result::Result<(), &'static str> {
    let bytes = label.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return Err("has an empty DNS label");
    };
    if !bytes
        .iter()
        .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err("may only contain lowercase letters, digits, '-' and '.' between labels");
    }
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return Err("must start and end each DNS label with a lowercase letter or digit");
    }
    Ok(())
}

/// Rejects what could change the meaning of a path or a C string, with a precise reason.
/// Validates the UUID of a whole GPU before it names a directory: `GPU-` followed by
/// hexadecimal digits and dashes, at most `MAX_GPU_UUID_LEN` characters. `MIG-` UUIDs are
/// refused: a MIG device never names a per-GPU directory.
///
/// # Errors
/// [`Error::InvalidName`] naming `field` when the value breaks the rule.
pub fn gpu_uuid<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    reject_path_hazards(field, value)?;
    check_len(
        field,
        value,
        MAX_GPU_UUID_LEN,
        "is longer than 64 characters",
    )?;
    let Some(rest) = value.strip_prefix("GPU-") else {
        return Err(invalid(field, value, "must start with \"GPU-\""));
    };
    if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
        return Err(invalid(
            field,
            value,
            "may only contain hexadecimal digits and '-' after \"GPU-\"",
        ));
    }
    Ok(value)
}

fn reject_path_hazards(field: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.contains('\0') {
        "must not contain a NUL byte"
    } else if value.contains('/') {
        "must not contain '/'"
    } else if value.contains("..") {
        "must not contain '..'"
    } else if value.chars().any(char::is_whitespace) {
        "must not contain whitespace"
    } else if value.starts_with('.') {
        "must not start with '.'"
    } else {
        return Ok(());
    };
    Err(invalid(field, value, reason))
}

fn check_len(field: &'static str, value: &str, max: usize, reason: &'static str) -> Result<()> {
    if value.len() > max {
        Err(invalid(field, value, reason))
    } else {
        Ok(())
    }
}

fn invalid(field: &'static str, value: &str, reason: &'static str) -> Error {
    Error::InvalidName {
        field,
        value: value.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Validator = for<'a> fn(&'static str, &'a str) -> Result<&'a str>;

    const VALIDATORS: [(&str, Validator); 6] = [
        ("claim_uid", claim_uid),
        ("namespace", namespace),
        ("object_name", object_name),
        ("dns_label", dns_label),
        ("dns_subdomain", dns_subdomain),
        ("driver_name", driver_name),
    ];

    fn reason_of(result: Result<&str>) -> &'static str {
        match result {
            Err(Error::InvalidName { reason, .. }) => reason,
            other => panic!("expected InvalidName, got {other:?}"),
        }
    }

    #[test]
    fn accepts_real_kubernetes_uid() {
        let uid = "3f1c5a8e-2b7d-4e6f-9a0b-1c2d3e4f5a6b";
        assert_eq!(claim_uid("claim.uid", uid).ok(), Some(uid));
    }

    #[test]
    fn uid_rejections_name_field_value_and_reason() {
        let err = claim_uid("claim.uid", "../etc")
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("invalid claim.uid \"../etc\": must not contain '/'")
        );
        assert_eq!(reason_of(claim_uid("claim.uid", "")), "must not be empty");
        assert_eq!(
            reason_of(claim_uid("claim.uid", "a..b")),
            "must not contain '..'"
        );
        assert_eq!(
            reason_of(claim_uid("claim.uid", "a\0b")),
            "must not contain a NUL byte"
        );
        assert_eq!(
            reason_of(claim_uid("claim.uid", "a b")),
            "must not contain whitespace"
        );
        assert_eq!(
            reason_of(claim_uid("claim.uid", "-abc")),
            "must not start with '-'"
        );
        assert_eq!(
            reason_of(claim_uid("claim.uid", ".abc")),
            "must not start with '.'"
        );
        assert_eq!(
            reason_of(claim_uid("claim.uid", "ABC")),
            "may only contain lowercase letters, digits and '-'"
        );
        assert_eq!(
            reason_of(claim_uid("claim.uid", &"a".repeat(65))),
            "is longer than 64 characters"
        );
        assert!(claim_uid("claim.uid", &"a".repeat(64)).is_ok());
    }

    #[test]
    fn labels() {
        assert!(dns_label("claim.namespace", "default").is_ok());
        assert!(dns_label("claim.namespace", "kube-system").is_ok());
        assert!(dns_label("claim.namespace", "0abc9").is_ok());
        assert!(namespace("claim.namespace", &"a".repeat(63)).is_ok());
        assert_eq!(
            reason_of(namespace("claim.namespace", &"a".repeat(64))),
            "is longer than 63 characters"
        );
        for bad in ["a.b", "-a", "a-", "A", "a_b"] {
            assert!(dns_label("claim.namespace", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn subdomains() {
        assert!(object_name("claim.name", "my-claim.v1").is_ok());
        assert!(dns_subdomain("claim.name", &"a".repeat(253)).is_ok());
        assert!(dns_subdomain("claim.name", &"a".repeat(254)).is_err());
        for bad in ["a.", "a.-b", "a-.b", "a.B", "a_b"] {
            assert!(object_name("claim.name", bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            reason_of(object_name("claim.name", "a..b")),
            "must not contain '..'"
        );
    }

    #[test]
    fn driver_names() {
        assert!(driver_name("driverName", "gpu.kerf.dev").is_ok());
        assert!(driver_name("driverName", &"a".repeat(63)).is_ok());
        assert!(driver_name("driverName", &"a".repeat(64)).is_err());
        assert!(driver_name("driverName", "gpu/kerf").is_err());
    }

    #[test]
    fn error_names_the_field_it_was_given() {
        match namespace("claim.namespace", "Bad") {
            Err(Error::InvalidName { field, value, .. }) => {
                assert_eq!(field, "claim.namespace");
                assert_eq!(value, "Bad");
            }
            other => panic!("expected InvalidName, got {other:?}"),
        }
    }

    fn hazard() -> impl Strategy<Value = &'static str> {
        prop_oneof![Just("/"), Just(".."), Just("\0")]
    }

    proptest! {
        #[test]
        fn every_validator_rejects_path_hazards(
            prefix in "[a-z0-9./\\-]{0,20}",
            hazard in hazard(),
            suffix in "[a-z0-9./\\-]{0,20}",
        ) {
            let value = format!("{prefix}{hazard}{suffix}");
            for (name, validate) in VALIDATORS {
                prop_assert!(validate("field", &value).is_err(), "{name} accepted {value:?}");
            }
        }

        #[test]
        fn generated_uuids_pass(bytes in proptest::array::uniform16(any::<u8>())) {
            let hex = format!("{:032x}", u128::from_be_bytes(bytes));
            let uid = format!(
                "{}-{}-{}-{}-{}",
                &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32]
            );
            prop_assert_eq!(claim_uid("claim.uid", &uid).ok(), Some(uid.as_str()));
            // A Kubernetes UID is also a valid label and subdomain.
            prop_assert!(dns_label("claim.uid", &uid).is_ok());
            prop_assert!(dns_subdomain("claim.uid", &uid).is_ok());
        }

        #[test]
        fn accepted_labels_are_accepted_subdomains(label in "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?") {
            prop_assert!(dns_label("f", &label).is_ok());
            prop_assert!(dns_subdomain("f", &label).is_ok());
            let dotted = format!("{label}.{label}");
            prop_assert!(dns_subdomain("f", &dotted).is_ok());
        }
    }
}
