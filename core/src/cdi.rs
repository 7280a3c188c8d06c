//! Container Device Interface (CDI): the spec model, its version and naming rules, the
//! per-claim spec generator and the spec files in the runtime's CDI directory.
//!
//! - [`Spec`] and friends: the document, as the upstream schema names its fields.
//! - [`Spec::minimum_version`]: the lowest `cdiVersion` the fields allow; kerf writes that.
//! - [`Spec::validate`]: the naming and content rules loaders enforce.
//! - [`generate`]: the transient spec of one claim.
//! - [`SpecEncoder`]: the same spec's bytes, with the node-wide edits checked and encoded
//!   once rather than per claim (the prepare path uses it).
//! - [`write_spec`] / [`remove_spec`]: atomic, durable spec files under e.g. `/var/run/cdi`.
//! - [`generate_for_workload`] / [`SpecEncoder::encode_for_workload`]: the same spec plus
//!   per-request variables and the mounts of the claim's KEP-5304 metadata files
//!   ([`metadata_files`], written by [`write_metadata_files`]).

mod encoder;
mod generate;
mod input;
mod metadata;
mod spec;
mod validate;
mod version;
mod workload;

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub use encoder::SpecEncoder;
pub use generate::{env_key, generate, generate_for_workload};
pub use input::{
    COMMON_DEVICE_NODES, ClaimSpec, ClaimSpecRequest, CommonEdits, DeviceNodePolicy, GeneratedSpec,
    MigCaps, PreparedDevice, READ_ONLY_BIND,
};
pub use metadata::{
    ClaimWorkload, METADATA_HOST_SUBDIR, POD_CLAIM_NAME_ANNOTATION, check_pod_claim_name,
    metadata_files, remove_metadata_files, remove_orphan_metadata, write_metadata_files,
};
pub use spec::{ContainerEdits, Device, DeviceNode, Hook, IntelRdt, Mount, NetDevice, Spec};
pub use validate::{parse_kind, validate_device_name, validate_env, validate_kind};
pub use version::CdiVersion;
pub use workload::workload_env_name;

use crate::error::{Error, Result};
use crate::fsutil;

/// The fully qualified CDI device name `vendor/class=name`: what NodePrepareResources
/// returns in `cdi_device_ids`.
pub fn qualified_name(kind: &str, device: &str) -> String {
    format!("{kind}={device}")
}

/// The CDI device name of one device of one claim, `<claim uid>-<device>`: unique per claim,
/// so that two claims sharing a GPU get their own devices with their own limits. Claim UIDs
/// may start with a digit, which makes such specs need CDI 0.5.0.
pub fn claim_device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// The name one of several shares of `device` in one claim takes in [`claim_device_name`]
/// (kube-scheduler may give two requests of a claim each a share of the same shareable GPU,
/// with their own share IDs): `<device>-<share>`, `<share>` being the first `len` letters and
/// digits of the share ID, lowercased (all of them when `len` is 0; `share` when it has none).
/// A share ID is a UUID the scheduler writes, so 8 characters tell a claim's shares apart
/// but for a rare collision, which the caller resolves with a longer `len`.
pub fn share_device_name(device: &str, share_id: &str, len: usize) -> String {
    let take = if len == 0 { usize::MAX } else { len };
    let share: String = share_id
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .take(take)
        .collect();
    if share.is_empty() {
        format!("{device}-share")
    } else {
        format!("{device}-{share}")
    }
}

/// The file name of a transient (per-claim) spec: `<vendor>-<class>_<id>.json`, with any
/// `/` in `id` replaced by `_`, as the reference implementation names them.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] when `kind` is not a valid `vendor/class`, or `id` is empty or
/// holds characters other than letters, digits, `_`, `.`, `:`, `-` (it becomes part of a path).
pub fn transient_spec_file_name(kind: &str, id: &str) -> Result<String> {
    let (vendor, class) = parse_kind(kind)?;
    let id = id.replace('/', "_");
    check_transient_id(&id)?;
    Ok(format!("{vendor}-{class}_{id}.json"))
}

/// Checks a transient spec id locally: it ends up in a file name, so only a small, safe
/// alphabet is accepted. (Claim UIDs are also checked by `names::claim_uid` at the API
/// boundary; this check keeps the file writer safe on its own.)
fn check_transient_id(id: &str) -> Result<()> {
    let safe = !id.is_empty()
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
    if safe {
        Ok(())
    } else {
        Err(Error::InvalidCdiSpec(format!(
            "spec id {id:?} must be non-empty, not start with '.', and use only letters, digits, _ . : -"
        )))
    }
}

/// Encodes a spec as compact JSON.
///
/// # Errors
///
/// [`Error::Json`] if serialisation fails (it does not for well-formed specs).
pub fn encode_spec(spec: &Spec) -> Result<Vec<u8>> {
    serde_json::to_vec(spec).map_err(|source| Error::Json {
        what: "encode CDI spec",
        source,
    })
}

/// Decodes a JSON spec as strictly as CDI loaders do (unknown fields are errors) and
/// validates it.
///
/// # Errors
///
/// [`Error::Json`] when the document does not decode, [`Error::InvalidCdiSpec`] when it
/// breaks a rule.
pub fn decode_spec(bytes: &[u8]) -> Result<Spec> {
    let spec: Spec = serde_json::from_slice(bytes).map_err(|source| Error::Json {
        what: "decode CDI spec",
        source,
    })?;
    spec.validate()?;
    Ok(spec)
}

/// Validates `spec` and writes it atomically and durably as the transient spec of
/// `claim_uid` in `dir`. Returns the file's path.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] for an invalid spec or claim UID, [`Error::Io`] when the write
/// fails (nothing is left behind then).
pub fn write_spec(dir: &Path, spec: &Spec, claim_uid: &str) -> Result<PathBuf> {
    spec.validate()?;
    let file_name = transient_spec_file_name(&spec.kind, claim_uid)?;
    let bytes = encode_spec(spec)?;
    fsutil::write_atomic(dir, &file_name, &bytes)?;
    Ok(dir.join(file_name))
}

/// Removes the transient spec of `claim_uid` durably. Returns whether it existed.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] for an invalid kind or claim UID, [`Error::Io`] when the removal
/// fails.
pub fn remove_spec(dir: &Path, kind: &str, claim_uid: &str) -> Result<bool> {
    let file_name = transient_spec_file_name(kind, claim_uid)?;
    fsutil::remove_durable(dir, &file_name)
}

/// Removes the transient specs of `kind` in `dir` whose claim is not in `owned` (left behind
/// by a crash between writing a spec and recording its claim). Returns how many were removed.
///
/// A file counts as one of ours only when its name has our `<vendor>-<class>_` prefix and
/// its content declares our `kind`, so another driver's files (even one whose class makes
/// the same prefix) are never touched; or when the rest of its name is a claim UID in
/// Kubernetes' `8-4-4-4-12` form and its content does not decode: specs are written without
/// fsync, so a power cut can bring back the name of a removed spec with its data lost, and
/// another driver whose class extends ours (`gpu_x`) would have a `_` there. Other files that
/// cannot be read or decoded are left alone. Call it when no prepare is running, e.g. at
/// start-up.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] for an invalid kind, [`Error::Io`] when `dir` cannot be listed
/// or a file cannot be removed. A missing `dir` holds no orphans.
pub fn remove_orphan_specs(dir: &Path, kind: &str, owned: &[String]) -> Result<usize> {
    let (vendor, class) = parse_kind(kind)?;
    let prefix = format!("{vendor}-{class}_");
    let owned: BTreeSet<String> = owned.iter().map(|id| id.replace('/', "_")).collect();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io("read dir", dir, e)),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read dir", dir, e))?;
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix)?.strip_suffix(".json"))
        else {
            continue;
        };
        if owned.contains(id) || !is_ours(&entry.path(), id, kind) {
            continue;
        }
        if let Some(file_name) = name.to_str()
            && fsutil::remove_if_exists(dir, file_name)?
        {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Whether the spec file at `path`, named for the transient id `id`, is one of ours (see
/// [`remove_orphan_specs`]); a file that cannot be read is not.
fn is_ours(path: &Path, id: &str, kind: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct KindOnly {
        kind: String,
    }
    let Ok(bytes) = fs::read(path) else {
        return false;
    };
    match serde_json::from_slice::<KindOnly>(&bytes) {
        Ok(declared) => declared.kind == kind,
        Err(_) => is_rfc4122_uid(id),
    }
}

/// `8-4-4-4-12` lowercase hex, as Kubernetes writes object UIDs.
fn is_rfc4122_uid(id: &str) -> bool {
    let groups: Vec<&str> = id.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(group, len)| {
            group.len() == len
                && group
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Test helpers may fail loudly.

    use super::*;

    const KIND: &str = "k8s.gpu.kerf.dev/gpu";
    const UID: &str = "0123abcd-0000-4000-8000-00000000beef";

    #[test]
    fn a_share_is_named_after_its_share_id_and_stays_a_valid_device_name() {
        let share = "AAAAAAAA-0000-4000-8000-000000000001";
        assert_eq!(share_device_name("gpu-0", share, 8), "gpu-0-aaaaaaaa");
        assert_eq!(
            share_device_name("gpu-0", share, 0),
            "gpu-0-aaaaaaaa000040008000000000000001"
        );
        assert_eq!(share_device_name("gpu-0", "--", 8), "gpu-0-share");
        validate_device_name(&claim_device_name(
            UID,
            &share_device_name("gpu-0", share, 8),
        ))
        .unwrap();
    }

    #[test]
    fn rfc4122_uids_are_recognised() {
        assert!(is_rfc4122_uid(UID));
        for other in [
            "garbage",
            "x_0123abcd-0000-4000-8000-00000000beef",
            "0123ABCD-0000-4000-8000-00000000beef",
            "0123abcd-0000-4000-8000-00000000beef-1",
            "0123abcd-0000-4000-8000-00000000beeg",
            "",
        ] {
            assert!(!is_rfc4122_uid(other), "{other}");
        }
    }

    /// What a power cut can leave of a spec removed without fsync: its name, with no data or
    /// part of it. Start-up removes it when no claim owns it, and leaves alone an undecodable
    /// file whose name is not a claim UID (another driver's, or a human's).
    #[test]
    fn an_emptied_or_torn_orphan_spec_is_removed_at_start_up() {
        let dir = tempfile::tempdir().unwrap();
        let empty = transient_spec_file_name(KIND, UID).unwrap();
        fs::write(dir.path().join(&empty), b"").unwrap();
        let other_uid = "0123abcd-0000-4000-8000-00000000cafe";
        let torn = transient_spec_file_name(KIND, other_uid).unwrap();
        fs::write(dir.path().join(&torn), br#"{"cdiVersion":"0.5.0","ki"#).unwrap();
        let owned_uid = "0123abcd-0000-4000-8000-00000000f00d";
        let owned = transient_spec_file_name(KIND, owned_uid).unwrap();
        fs::write(dir.path().join(&owned), b"").unwrap();
        let not_a_uid = dir.path().join("k8s.gpu.kerf.dev-gpu_x_notes.json");
        fs::write(&not_a_uid, b"").unwrap();

        let removed = remove_orphan_specs(dir.path(), KIND, &[owned_uid.to_owned()]).unwrap();
        assert_eq!(removed, 2);
        assert!(!dir.path().join(empty).exists());
        assert!(!dir.path().join(torn).exists());
        assert!(
            dir.path().join(owned).exists(),
            "its claim's restore rewrites it"
        );
        assert!(not_a_uid.exists());
    }
}
