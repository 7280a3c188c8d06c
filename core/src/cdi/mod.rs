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
mod metadata;
mod spec;
mod validate;
mod version;
mod workload;

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub use encoder::{EncodedSpec, SpecEncoder};
pub use generate::{
    COMMON_DEVICE_NODES, ClaimSpec, ClaimSpecRequest, CommonEdits, DeviceNodePolicy, GeneratedSpec,
    MigCaps, PreparedDevice, READ_ONLY_BIND, env_key, generate, generate_for_workload,
};
pub use metadata::{
    CLAIM_FILE, CLAIM_FILES_CONTAINER_DIR, ClaimWorkload, ContainerClaimName, METADATA_API_VERSION,
    METADATA_CONTAINER_DIR, METADATA_HOST_SUBDIR, METADATA_KIND, MetadataFile,
    POD_CLAIM_NAME_ANNOTATION, RESOURCE_CLAIM_TEMPLATES_SUBDIR, RESOURCE_CLAIMS_SUBDIR,
    TEMPLATE_CLAIM_FILES_CONTAINER_DIR, WorkloadRequest, check_pod_claim_name,
    claim_container_path, claim_metadata_dir, metadata_files, remove_metadata_files,
    remove_orphan_metadata, request_container_path, requests_of, write_metadata_files,
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
/// the same prefix) are never touched. Files that cannot be read or decoded are left alone.
/// Call it when no prepare is running, e.g. at start-up.
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
        if owned.contains(id) || !declares_kind(&entry.path(), kind) {
            continue;
        }
        if let Some(file_name) = name.to_str()
            && fsutil::remove_durable(dir, file_name)?
        {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Whether the spec file at `path` declares `kind`; unreadable or undecodable files do not.
fn declares_kind(path: &Path, kind: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct KindOnly {
        kind: String,
    }
    fs::read(path)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<KindOnly>(&bytes).ok())
        .is_some_and(|k| k.kind == kind)
}
