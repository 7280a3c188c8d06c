//! Device metadata files: one JSON file per request of a claim, plus one per claim,
//! describing the claim's devices to the workload, in the layout and schema of KEP-5304
//! ("DRA device metadata to pods", alpha in Kubernetes 1.36).
//!
//! # Layout (KEP-5304)
//!
//! Upstream (`k8s.io/dynamic-resource-allocation/api/metadata`, `types.go` constants and
//! `helpers.go` `ResourceClaimFilePath` / `ResourceClaimTemplateFilePath`) fixes where a
//! workload finds the file of a request inside its container:
//!
//! - a claim the pod names directly (`pod.spec.resourceClaims[].resourceClaimName`):
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim name>/<request>/<driver>-metadata.json`;
//! - a claim made from a ResourceClaimTemplate, whose generated name a container cannot know:
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/<pod claim name>/<request>/<driver>-metadata.json`,
//!   the pod claim name being `pod.spec.resourceClaims[].name`, which kube-controller-manager's
//!   resourceclaim controller records on the generated claim as the annotation
//!   `resource.kubernetes.io/pod-claim-name` ([`POD_CLAIM_NAME_ANNOTATION`]).
//!
//! `<request>` is the top-level request name: a `firstAvailable` result `parent/sub` lives
//! under `parent`, while the file's `requests[].name` is the full `parent/sub` (upstream
//! `DeviceMetadataRequest.Name`).
//!
//! kerf also mounts a claim-wide file, the same schema with every request of the claim, for
//! workloads that want one file, split the same way so that a direct claim and a template
//! claim of one pod never collide: `/var/run/kerf/claims/<claim name>.json` and
//! `/var/run/kerf/claimtemplates/<pod claim name>.json`.
//!
//! # Schema (KEP-5304 `metadata.resource.k8s.io/v1alpha1`)
//!
//! A `DeviceMetadata` object (upstream `api/metadata/v1alpha1/types.go`): `kind`,
//! `apiVersion`, `metadata` (`name`, `namespace`, `uid`, `generation`), `requests[]` of
//! `{name, devices[]}` and, for a template claim, `podClaimName`; each device `{driver, pool, name, attributes}` with attributes in
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

use super::input::{ClaimSpec, PreparedDevice};
use crate::error::{Error, Result};
use crate::names;

/// Where KEP-5304 metadata files appear inside containers.
pub(crate) const METADATA_CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// The KEP-5304 subdirectory of directly referenced claims, keyed by claim name.
pub(crate) const RESOURCE_CLAIMS_SUBDIR: &str = "resourceclaims";

/// The KEP-5304 subdirectory of claims made from a ResourceClaimTemplate, keyed by pod claim
/// name.
pub(crate) const RESOURCE_CLAIM_TEMPLATES_SUBDIR: &str = "resourceclaimtemplates";

/// Where kerf's claim-wide files of directly referenced claims appear inside containers, as
/// `<claim name>.json`.
pub(crate) const CLAIM_FILES_CONTAINER_DIR: &str = "/var/run/kerf/claims";

/// Where kerf's claim-wide files of claims made from a template appear inside containers, as
/// `<pod claim name>.json`.
pub(crate) const TEMPLATE_CLAIM_FILES_CONTAINER_DIR: &str = "/var/run/kerf/claimtemplates";

/// The annotation kube-controller-manager's resourceclaim controller puts on a claim it
/// generates from a template, holding `pod.spec.resourceClaims[].name` (upstream
/// `pkg/controller/resourceclaim/controller.go`, `podResourceClaimAnnotation`).
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// The subdirectory of the plugin's data directory holding the metadata files.
pub const METADATA_HOST_SUBDIR: &str = "dra-device-metadata";

/// The host file name of the claim-wide file inside a claim's directory; request files are
/// `<request>.json`, and request names cannot contain `.`.
pub(crate) const CLAIM_FILE: &str = "claim.json";

/// `apiVersion` of the files.
pub(crate) const METADATA_API_VERSION: &str = "metadata.resource.k8s.io/v1alpha1";

/// `kind` of the files.
pub(crate) const METADATA_KIND: &str = "DeviceMetadata";

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
    /// The full request names of each device's allocation results (`parent/sub` for a
    /// `firstAvailable` subrequest), index-aligned with [`ClaimSpec::devices`], named in the
    /// files' `requests[].name`. An empty slice, or an empty list for a device (checkpoints
    /// from before they were recorded), lets the top-level names stand in.
    pub request_refs: &'a [Vec<String>],
    /// The pod claim name of a claim made from a ResourceClaimTemplate (see the module docs):
    /// when set, the in-container paths and claim-named variables use it instead of the claim
    /// name.
    pub pod_claim_name: Option<&'a str>,
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
pub(crate) fn claim_metadata_dir(metadata_dir: &Path, claim_uid: &str) -> PathBuf {
    metadata_dir.join(claim_uid)
}

/// The name a container knows a claim by, and so the directory its files appear under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContainerClaimName<'a> {
    /// A claim the pod names directly: its own name.
    Claim(&'a str),
    /// A claim made from a ResourceClaimTemplate: the pod claim name.
    PodClaim(&'a str),
}

impl<'a> ContainerClaimName<'a> {
    /// The pod claim name when there is one, else the claim name.
    pub fn of(claim_name: &'a str, pod_claim_name: Option<&'a str>) -> Self {
        pod_claim_name.map_or(
            ContainerClaimName::Claim(claim_name),
            ContainerClaimName::PodClaim,
        )
    }

    /// The name itself.
    pub fn name(self) -> &'a str {
        match self {
            ContainerClaimName::Claim(name) | ContainerClaimName::PodClaim(name) => name,
        }
    }
}

/// The in-container path of the KEP-5304 file of `request` of a claim.
pub(crate) fn request_container_path(
    driver: &str,
    claim: ContainerClaimName<'_>,
    request: &str,
) -> String {
    let subdir = match claim {
        ContainerClaimName::Claim(_) => RESOURCE_CLAIMS_SUBDIR,
        ContainerClaimName::PodClaim(_) => RESOURCE_CLAIM_TEMPLATES_SUBDIR,
    };
    [
        METADATA_CONTAINER_DIR,
        "/",
        subdir,
        "/",
        claim.name(),
        "/",
        request,
        "/",
        driver,
        "-metadata.json",
    ]
    .concat()
}

/// The in-container path of kerf's claim-wide file.
pub(crate) fn claim_container_path(claim: ContainerClaimName<'_>) -> String {
    let dir = match claim {
        ContainerClaimName::Claim(_) => CLAIM_FILES_CONTAINER_DIR,
        ContainerClaimName::PodClaim(_) => TEMPLATE_CLAIM_FILES_CONTAINER_DIR,
    };
    [dir, "/", claim.name(), ".json"].concat()
}

/// Checks a pod claim name (the value of [`POD_CLAIM_NAME_ANNOTATION`]) before it becomes a
/// path segment: a DNS label, as the API requires of `pod.spec.resourceClaims[].name`.
///
/// # Errors
///
/// [`Error::InvalidName`] naming the annotation and the value.
pub fn check_pod_claim_name(value: &str) -> Result<&str> {
    names::dns_label(POD_CLAIM_NAME_ANNOTATION, value)
}

/// One request of a claim as its workload sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkloadRequest {
    /// The top-level request name: the directory of its file and the `<REQ>` of its
    /// variables.
    pub name: String,
    /// The allocation results' full name, `parent/sub` for a `firstAvailable` subrequest
    /// (the same for every device of the request, since one subrequest is chosen), or
    /// [`WorkloadRequest::name`] when not recorded.
    pub full_name: String,
    /// The indices of its devices in [`ClaimSpec::devices`].
    pub devices: Vec<usize>,
}

impl ClaimWorkload<'_> {
    /// The name the claim's container paths and claim-named variables use.
    pub(crate) fn container_name<'c>(&'c self, claim: &ClaimSpec<'c>) -> ContainerClaimName<'c> {
        ContainerClaimName::of(claim.claim_name, self.pod_claim_name)
    }
}

/// The requests of the claim with the indices of their devices, in order of first use.
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] when `requests` (or a non-empty `request_refs`) is not
/// index-aligned with the devices, a device serves no request, or a request name is not a
/// DNS label (it becomes a path segment and part of an environment variable name), or a full
/// name is not `<label>` or `<label>/<label>`; [`Error::InvalidName`] for a pod claim name
/// that is not a DNS label.
pub(crate) fn requests_of(
    claim: &ClaimSpec<'_>,
    workload: &ClaimWorkload<'_>,
) -> Result<Vec<WorkloadRequest>> {
    let aligned = |what: &str, len: usize| {
        if len == claim.devices.len() {
            Ok(())
        } else {
            Err(Error::InvalidCdiSpec(format!(
                "claim {}: {len} {what} lists for {} devices",
                claim.claim_uid,
                claim.devices.len()
            )))
        }
    };
    aligned("request", workload.requests.len())?;
    if !workload.request_refs.is_empty() {
        aligned("request reference", workload.request_refs.len())?;
    }
    if let Some(name) = workload.pod_claim_name {
        check_pod_claim_name(name)?;
    }
    let mut out: Vec<WorkloadRequest> = Vec::new();
    for (index, (device, requests)) in claim.devices.iter().zip(workload.requests).enumerate() {
        if requests.is_empty() {
            return Err(Error::InvalidCdiSpec(format!(
                "claim {}: device {:?} serves no request",
                claim.claim_uid, device.name
            )));
        }
        let refs = workload
            .request_refs
            .get(index)
            .map_or(&[][..], Vec::as_slice);
        for reference in refs {
            check_request_ref(reference)?;
        }
        for request in requests {
            check_request_name(request)?;
            match out.iter_mut().find(|r| r.name == *request) {
                Some(known) => known.devices.push(index),
                None => out.push(WorkloadRequest {
                    name: request.clone(),
                    full_name: full_name(request, refs).to_owned(),
                    devices: vec![index],
                }),
            }
        }
    }
    Ok(out)
}

/// The full name among `refs` whose top-level request is `request`, else `request`.
fn full_name<'a>(request: &'a str, refs: &'a [String]) -> &'a str {
    refs.iter()
        .map(String::as_str)
        .find(|r| r.split_once('/').map_or(*r, |(parent, _)| parent) == request)
        .unwrap_or(request)
}

/// A full request name: `<request>` or `<request>/<subrequest>`, both DNS labels.
fn check_request_ref(reference: &str) -> Result<()> {
    let (parent, sub) = reference
        .split_once('/')
        .map_or((reference, None), |(p, s)| (p, Some(s)));
    check_request_name(parent)?;
    sub.map_or(Ok(()), check_request_name)
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
/// The errors of `requests_of`; [`Error::Json`] if encoding fails (it does not).
pub fn metadata_files(
    claim: &ClaimSpec<'_>,
    workload: &ClaimWorkload<'_>,
) -> Result<Vec<MetadataFile>> {
    let requests = requests_of(claim, workload)?;
    let document = |requests: &[WorkloadRequest]| -> Result<Vec<u8>> {
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
            name: [request.name.as_str(), ".json"].concat(),
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pod_claim_name: Option<&'a str>,
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
        requests: &'a [WorkloadRequest],
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
            pod_claim_name: workload.pod_claim_name,
            requests: requests
                .iter()
                .map(|request| MetadataRequest {
                    name: &request.full_name,
                    devices: request
                        .devices
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
