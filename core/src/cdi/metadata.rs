//! Device metadata files: one JSON file per request of a claim, plus one per claim,
//! describing the claim's devices to the workload, in the layout and schema of KEP-5304
//! ("DRA device metadata to pods", alpha in Kubernetes 1.36).
//!
//! # Layout (KEP-5304)
//!
//! Upstream (`k8s.io/dynamic-resource-allocation/api/metadata`, `types.go` / `helpers.go`
//! `ResourceClaimFilePath`) fixes where a workload finds the file of a request inside its
//! container: `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim name>/
//! <request>/<driver>-metadata.json`. The request is the top-level name (a `firstAvailable`
//! result `parent/sub` lives under `parent`). Upstream puts claims made from a
//! ResourceClaimTemplate under `resourceclaimtemplates/<pod claim name>/` instead; kerf's
//! checkpoint does not record the pod claim name, so kerf mounts every claim under
//! `resourceclaims/<claim name>/` (see the plugin's report of what the checkpoint would need).
//!
//! kerf also mounts the claim-wide file at `/var/run/kerf/claims/<claim name>.json`: the same
//! schema with every request of the claim, for workloads that want one file.
//!
//! # Schema (KEP-5304 `metadata.resource.k8s.io/v1alpha1`)
//!
//! A `DeviceMetadata` object (upstream `api/metadata/v1alpha1/types.go`): `kind`,
//! `apiVersion`, `metadata` (`name`, `namespace`, `uid`, `generation`), `requests[]` of
//! `{name, devices[]}`, each device `{driver, pool, name, attributes}` with attributes in
//! ResourceSlice form (`{"string": …}`, `{"int": …}`). Upstream writes a stream of one object
//! per supported version; kerf writes the one version there is. A file is written once per
//! preparation and never updated, so `generation` stays 1.
//!
//! # Host side
//!
//! The files live in a subdirectory of the plugin's data directory, as upstream's kubelet
//! plugin library keeps them (`kubeletplugin/metadata.go`, `{pluginDataDir}/dra-device-metadata`):
//! `<plugin dir>/dra-device-metadata/<claim uid>/`. Like the specs they are rebuilt from the
//! checkpoint at start-up (files of claims no entry owns are removed then) and need no fsync
//! of their own.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::generate::{ClaimSpec, PreparedDevice};
use crate::error::{Error, Result};

/// Where KEP-5304 metadata files appear inside containers.
pub const METADATA_CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// The KEP-5304 subdirectory of directly referenced claims, keyed by claim name.
pub const RESOURCE_CLAIMS_SUBDIR: &str = "resourceclaims";

/// Where kerf's claim-wide files appear inside containers, as `<claim name>.json`.
pub const CLAIM_FILES_CONTAINER_DIR: &str = "/var/run/kerf/claims";

/// The subdirectory of the plugin's data directory holding the metadata files.
pub const METADATA_HOST_SUBDIR: &str = "dra-device-metadata";

/// The host file name of the claim-wide file inside a claim's directory; request files are
/// `<request>.json`, and request names cannot contain `.`.
pub const CLAIM_FILE: &str = "claim.json";

/// `apiVersion` of the files.
pub const METADATA_API_VERSION: &str = "metadata.resource.k8s.io/v1alpha1";

/// `kind` of the files.
pub const METADATA_KIND: &str = "DeviceMetadata";

/// What a claim's metadata files are made from besides its [`ClaimSpec`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimWorkload<'a> {
    /// The DRA driver name, e.g. `gpu.kerf.dev`: the `driver` of every device and part of
    /// the file name inside the container.
    pub driver: &'a str,
    /// The pool of the claim's devices (the node name).
    pub pool: &'a str,
    /// The requests each device serves, index-aligned with [`ClaimSpec::devices`]: top-level
    /// request names, as the kubelet matches containers to devices.
    pub requests: &'a [Vec<String>],
    /// The node's metadata directory on the host, `<plugin dir>/dra-device-metadata`.
    pub metadata_dir: &'a Path,
}

/// One file of a claim: its name in the claim's host directory and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataFile {
    /// [`CLAIM_FILE`] or `<request>.json`.
    pub name: String,
    /// The JSON document.
    pub contents: Vec<u8>,
}

/// The host directory of one claim's files.
pub fn claim_metadata_dir(metadata_dir: &Path, claim_uid: &str) -> PathBuf {
    metadata_dir.join(claim_uid)
}

/// The in-container path of the KEP-5304 file of `request` of the claim `claim_name`.
pub fn request_container_path(driver: &str, claim_name: &str, request: &str) -> String {
    [
        METADATA_CONTAINER_DIR,
        "/",
        RESOURCE_CLAIMS_SUBDIR,
        "/",
        claim_name,
        "/",
        request,
        "/",
        driver,
        "-metadata.json",
    ]
    .concat()
}

/// The in-container path of kerf's claim-wide file.
pub fn claim_container_path(claim_name: &str) -> String {
    [CLAIM_FILES_CONTAINER_DIR, "/", claim_name, ".json"].concat()
}

/// The requests of the claim with the indices of their devices, in order of first use.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] when `requests` is not index-aligned with the devices, a device
/// serves no request, or a request name is not a DNS label (it becomes a path segment and
/// part of an environment variable name).
pub fn requests_of(
    claim: &ClaimSpec<'_>,
    workload: &ClaimWorkload<'_>,
) -> Result<Vec<(String, Vec<usize>)>> {
    if workload.requests.len() != claim.devices.len() {
        return Err(Error::InvalidCdiSpec(format!(
            "claim {}: {} request lists for {} devices",
            claim.claim_uid,
            workload.requests.len(),
            claim.devices.len()
        )));
    }
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    for (index, (device, requests)) in claim.devices.iter().zip(workload.requests).enumerate() {
        if requests.is_empty() {
            return Err(Error::InvalidCdiSpec(format!(
                "claim {}: device {:?} serves no request",
                claim.claim_uid, device.name
            )));
        }
        for request in requests {
            check_request_name(request)?;
            match out.iter_mut().find(|(name, _)| name == request) {
                Some((_, indices)) => indices.push(index),
                None => out.push((request.clone(), vec![index])),
            }
        }
    }
    Ok(out)
}

/// A request name as the API allows it (a DNS label), so that it is safe in a path.
fn check_request_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidCdiSpec(format!(
            "request name {name:?} must be a DNS label (lower-case letters, digits, '-')"
        )))
    }
}

/// The claim's files: one per request (only that request) and the claim-wide one.
///
/// # Errors
///
/// The errors of [`requests_of`]; [`Error::Json`] if encoding fails (it does not).
pub fn metadata_files(
    claim: &ClaimSpec<'_>,
    workload: &ClaimWorkload<'_>,
) -> Result<Vec<MetadataFile>> {
    let requests = requests_of(claim, workload)?;
    let document = |requests: &[(String, Vec<usize>)]| -> Result<Vec<u8>> {
        let doc = DeviceMetadata::new(claim, workload, requests);
        let mut bytes = serde_json::to_vec_pretty(&doc).map_err(|source| Error::Json {
            what: "encode device metadata",
            source,
        })?;
        bytes.push(b'\n');
        Ok(bytes)
    };
    let mut files = Vec::with_capacity(requests.len() + 1);
    for request in &requests {
        files.push(MetadataFile {
            name: [request.0.as_str(), ".json"].concat(),
            contents: document(std::slice::from_ref(request))?,
        });
    }
    files.push(MetadataFile {
        name: CLAIM_FILE.to_owned(),
        contents: document(&requests)?,
    });
    Ok(files)
}

/// `metadata.resource.k8s.io/v1alpha1` `DeviceMetadata`, the fields kerf fills.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DeviceMetadata<'a> {
    kind: &'static str,
    api_version: &'static str,
    metadata: ObjectMeta<'a>,
    requests: Vec<MetadataRequest<'a>>,
}

#[derive(Serialize)]
struct ObjectMeta<'a> {
    name: &'a str,
    namespace: &'a str,
    uid: &'a str,
    generation: u64,
}

#[derive(Serialize)]
struct MetadataRequest<'a> {
    name: &'a str,
    devices: Vec<MetadataDevice<'a>>,
}

#[derive(Serialize)]
struct MetadataDevice<'a> {
    driver: &'a str,
    pool: &'a str,
    name: &'a str,
    attributes: BTreeMap<&'static str, Attribute<'a>>,
}

/// A ResourceSlice `DeviceAttribute`: exactly one of its fields is set.
#[derive(Serialize)]
#[serde(rename_all = "lowercase")]
enum Attribute<'a> {
    String(&'a str),
    Int(i64),
}

impl<'a> DeviceMetadata<'a> {
    fn new(
        claim: &ClaimSpec<'a>,
        workload: &ClaimWorkload<'a>,
        requests: &'a [(String, Vec<usize>)],
    ) -> Self {
        DeviceMetadata {
            kind: METADATA_KIND,
            api_version: METADATA_API_VERSION,
            metadata: ObjectMeta {
                name: claim.claim_name,
                namespace: claim.claim_namespace,
                uid: claim.claim_uid,
                generation: 1,
            },
            requests: requests
                .iter()
                .map(|(name, indices)| MetadataRequest {
                    name,
                    devices: indices
                        .iter()
                        .map(|&i| metadata_device(workload, &claim.devices[i]))
                        .collect(),
                })
                .collect(),
        }
    }
}

/// A device with the attributes a workload needs to find and size it: `uuid` and `minor`
/// as kerf publishes them, and the slice it was given (`sharing`, and `memoryBytes` /
/// `computePercent` when limited).
fn metadata_device<'a>(
    workload: &ClaimWorkload<'a>,
    device: &'a PreparedDevice,
) -> MetadataDevice<'a> {
    let mut attributes = BTreeMap::new();
    attributes.insert("uuid", Attribute::String(&device.uuid));
    attributes.insert("minor", Attribute::Int(i64::from(device.gpu_minor)));
    attributes.insert("sharing", Attribute::String(device.sharing.as_str()));
    if let Some(bytes) = device.limits.memory_bytes {
        attributes.insert(
            "memoryBytes",
            Attribute::Int(i64::try_from(bytes).unwrap_or(i64::MAX)),
        );
    }
    if let Some(percent) = device.limits.compute_percent {
        attributes.insert("computePercent", Attribute::Int(i64::from(percent)));
    }
    MetadataDevice {
        driver: workload.driver,
        pool: workload.pool,
        name: &device.name,
        attributes,
    }
}

/// Writes a claim's files into its host directory, replacing each atomically (a container
/// never sees half a file) but without fsync: the files are rebuilt from the checkpoint at
/// start-up, so a crash cannot lose them for good.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] for a claim UID that is unsafe in a path, [`Error::Io`] when a
/// directory or file cannot be written.
pub fn write_metadata_files(
    metadata_dir: &Path,
    claim_uid: &str,
    files: &[MetadataFile],
) -> Result<PathBuf> {
    check_uid(claim_uid)?;
    let dir = claim_metadata_dir(metadata_dir, claim_uid);
    fs::create_dir_all(&dir).map_err(|e| Error::io("create dir", &dir, e))?;
    for file in files {
        let target = dir.join(&file.name);
        let temp = dir.join([".", file.name.as_str(), ".tmp"].concat());
        fs::write(&temp, &file.contents).map_err(|e| Error::io("write", &temp, e))?;
        fs::rename(&temp, &target).map_err(|e| Error::io("rename", &target, e))?;
    }
    Ok(dir)
}

/// Removes a claim's files. Returns whether there were any.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] for a claim UID that is unsafe in a path, [`Error::Io`] when the
/// directory cannot be removed.
pub fn remove_metadata_files(metadata_dir: &Path, claim_uid: &str) -> Result<bool> {
    check_uid(claim_uid)?;
    let dir = claim_metadata_dir(metadata_dir, claim_uid);
    match fs::remove_dir_all(&dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("remove dir", dir, e)),
    }
}

/// Removes the claim directories whose claim is not in `owned`. Returns how many.
///
/// # Errors
///
/// [`Error::Io`] when `metadata_dir` cannot be listed or a directory cannot be removed. A
/// missing `metadata_dir` holds no orphans.
pub fn remove_orphan_metadata(metadata_dir: &Path, owned: &[String]) -> Result<usize> {
    let entries = match fs::read_dir(metadata_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io("read dir", metadata_dir, e)),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read dir", metadata_dir, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if owned.contains(&name) || check_uid(&name).is_err() {
            continue;
        }
        if remove_metadata_files(metadata_dir, &name)? {
            removed += 1;
        }
    }
    Ok(removed)
}

/// A claim UID becomes a directory name: only a safe alphabet is accepted.
fn check_uid(uid: &str) -> Result<()> {
    let ok = !uid.is_empty()
        && !uid.starts_with('.')
        && uid
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidCdiSpec(format!(
            "claim uid {uid:?} must be non-empty and use only letters, digits, - _"
        )))
    }
}
