//! A per-node CDI spec encoder that does the node-wide work once.
//!
//! Every claim's spec carries the same [`CommonEdits`] (dozens of driver mounts, the control
//! device nodes, extra env), and cloning, validating and serialising them dominated the cost
//! of [`generate`](super::generate) + [`encode_spec`](super::encode_spec). [`SpecEncoder`]
//! validates and serialises them once; per claim it builds, validates and serialises only
//! the claim's devices and claim-level env, and splices the pre-encoded common part in.
//!
//! # The splice
//!
//! A generated spec's spec-wide `containerEdits` is the last field of the document, and
//! within it the field order is `env`, `deviceNodes`, `mounts` (the struct's declaration
//! order, which serde keeps). The claim env comes first in `env` and is never empty. So the
//! claim-only spec encodes as `…,"containerEdits":{"env":[<claim env>]}}`, and the full spec
//! is that with the closing `]}}` replaced by the common tail
//! `[,<common env>]][,"deviceNodes":[…]][,"mounts":[…]]}}`. Every piece, key or string, is
//! produced by serde_json from the spec types themselves; the splice only adds the commas
//! between pieces and removes the brackets serde_json put around them.

use std::collections::BTreeMap;

use super::generate::{
    ClaimPart, check_has_devices, claim_part, common_device_nodes, host_path_override,
};
use super::input::{ClaimSpec, CommonEdits, DeviceNodePolicy};
use super::metadata::ClaimWorkload;
use super::spec::{ContainerEdits, Device, Spec};
use super::version::CdiVersion;
use crate::error::{Error, Result};

/// The encoded spec of one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedSpec {
    /// The spec as compact JSON, byte for byte what [`encode_spec`](super::encode_spec) writes
    /// for the [`generate`](super::generate)d spec.
    pub bytes: Vec<u8>,
    /// `vendor/class=<claim uid>-<device>` per input device, in input order.
    pub device_ids: Vec<String>,
}

/// Encodes the per-claim CDI specs of one node: built once from the CDI kind, the common
/// edits and the device-node policy, then [`SpecEncoder::encode`] per claim.
///
/// `SpecEncoder::new(kind, common, policy)?.encode(&request.claim())` gives the same bytes
/// and device ids as [`generate`](super::generate) + [`encode_spec`](super::encode_spec) for
/// a request with that kind and common edits, at a fraction of the cost.
#[derive(Debug, Clone)]
pub struct SpecEncoder {
    kind: String,
    /// The policy's host path, checked to be UTF-8.
    host_path: Option<String>,
    /// What the kind and the common edits need; the claim part may need more.
    common_version: CdiVersion,
    /// The encoded common edits, from the claim env's closing `]` to the end of the spec.
    common_tail: Vec<u8>,
}

/// The name of the stand-in device that lets [`Spec::validate`] check the common edits
/// (a spec without devices is invalid on that ground alone).
const PROBE_DEVICE: &str = "probe";

/// Roughly what the claim-only spec takes besides its devices, so that encoding rarely
/// reallocates.
const CLAIM_JSON_BYTES: usize = 512;

/// Roughly what one device takes (a MIG device with limits, a 36-character claim UID).
const DEVICE_JSON_BYTES: usize = 768;

/// What the encoded claim-only spec ends with: its claim env's `]`, then the closing braces
/// of `containerEdits` and of the spec.
const CLAIM_ONLY_END: &[u8] = b"]}}";

impl SpecEncoder {
    /// Validates the kind, the policy and the common edits once and pre-encodes the edits.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCdiSpec`] for an invalid kind, a device-node host path that is not
    /// valid UTF-8 (with [`generate`](super::generate)'s messages), or common edits that are
    /// invalid, including a relative host path when there are common device nodes (with the
    /// messages [`generate`](super::generate) gives for them in the spec-wide edits).
    /// [`Error::Json`] if encoding fails (it does not for valid edits).
    pub fn new(kind: &str, common: &CommonEdits, policy: &DeviceNodePolicy) -> Result<Self> {
        let host_path = host_path_override(policy)?.map(str::to_owned);
        let edits = ContainerEdits {
            env: common.env.clone(),
            device_nodes: common_device_nodes(common, host_path.as_deref()),
            mounts: common.mounts.clone(),
            ..ContainerEdits::default()
        };
        let probe = validated_probe(kind, edits)?;
        let common_version = probe.cdi_version;
        let common_tail = encode_common_tail(probe.container_edits)?;
        Ok(SpecEncoder {
            kind: kind.to_owned(),
            host_path,
            common_version,
            common_tail,
        })
    }

    /// The CDI kind the specs are of.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Encodes the spec of one claim: the same bytes as
    /// `encode_spec(&generate(&request, policy)?.spec)` for a request with this encoder's kind
    /// and common edits, and the same device ids, in input order.
    ///
    /// Only the claim-specific parts (device names, per-device edits, claim env) are
    /// validated; the common edits were validated by [`SpecEncoder::new`].
    ///
    /// # Errors
    ///
    /// The errors [`generate`](super::generate) gives for the claim: [`Error::InvalidCdiSpec`]
    /// when the claim has no devices, a name makes an invalid CDI device name, two devices
    /// collide on a name or env key, or a claim value makes an invalid env entry.
    /// [`Error::Json`] if encoding fails (it does not for valid specs).
    pub fn encode(&self, claim: &ClaimSpec<'_>) -> Result<EncodedSpec> {
        self.encode_spec(claim, None)
    }

    /// [`SpecEncoder::encode`] with the names a workload can use: the same bytes as
    /// [`generate_for_workload`](super::generate_for_workload) + [`encode_spec`](super::encode_spec).
    ///
    /// # Errors
    ///
    /// The errors of [`SpecEncoder::encode`] and those
    /// [`generate_for_workload`](super::generate_for_workload) adds for `workload`.
    pub fn encode_for_workload(
        &self,
        claim: &ClaimSpec<'_>,
        workload: &ClaimWorkload<'_>,
    ) -> Result<EncodedSpec> {
        self.encode_spec(claim, Some(workload))
    }

    fn encode_spec(
        &self,
        claim: &ClaimSpec<'_>,
        workload: Option<&ClaimWorkload<'_>>,
    ) -> Result<EncodedSpec> {
        check_has_devices(claim)?;
        let ClaimPart {
            devices,
            env,
            device_ids,
        } = claim_part(&self.kind, claim, self.host_path.as_deref(), workload)?;
        let claim_only = self.claim_only_spec(devices, env)?;
        let bytes = self.splice(&claim_only)?;
        Ok(EncodedSpec { bytes, device_ids })
    }

    /// The spec without the common edits, at the version the whole spec needs, validated.
    fn claim_only_spec(&self, devices: Vec<Device>, env: Vec<String>) -> Result<Spec> {
        let mut spec = Spec {
            cdi_version: CdiVersion::V0_3_0,
            kind: self.kind.clone(),
            annotations: BTreeMap::new(),
            devices,
            container_edits: ContainerEdits {
                env,
                ..ContainerEdits::default()
            },
        };
        spec.cdi_version = spec.minimum_version().max(self.common_version);
        spec.validate()?;
        Ok(spec)
    }

    /// Encodes `claim_only` with the common tail in place of its closing `]}}`.
    fn splice(&self, claim_only: &Spec) -> Result<Vec<u8>> {
        let estimate = CLAIM_JSON_BYTES + DEVICE_JSON_BYTES * claim_only.devices.len();
        let mut bytes = Vec::with_capacity(estimate + self.common_tail.len());
        serde_json::to_writer(&mut bytes, claim_only).map_err(|source| Error::Json {
            what: "encode CDI spec",
            source,
        })?;
        let head_len = bytes
            .strip_suffix(CLAIM_ONLY_END)
            .map(<[u8]>::len)
            .ok_or_else(|| unexpected_json("claim spec", CLAIM_ONLY_END))?;
        bytes.truncate(head_len);
        bytes.extend_from_slice(&self.common_tail);
        Ok(bytes)
    }
}

/// A spec of `kind` with `edits` as its spec-wide edits and a stand-in device, at the
/// version the kind and the edits need, validated: it checks the common edits the way
/// [`Spec::validate`] sees them in a generated spec.
fn validated_probe(kind: &str, edits: ContainerEdits) -> Result<Spec> {
    let mut probe = Spec {
        cdi_version: CdiVersion::V0_3_0,
        kind: kind.to_owned(),
        annotations: BTreeMap::new(),
        devices: vec![Device {
            name: PROBE_DEVICE.to_owned(),
            annotations: BTreeMap::new(),
            container_edits: ContainerEdits::default(),
        }],
        container_edits: edits,
    };
    // The probe device's name starts with a letter and it has no edits: it needs nothing.
    probe.cdi_version = probe.minimum_version();
    probe.validate()?;
    Ok(probe)
}

/// `[,<env entries>]][,"deviceNodes":[…]][,"mounts":[…]]}}`: the common edits as they follow
/// the last claim env entry.
fn encode_common_tail(mut edits: ContainerEdits) -> Result<Vec<u8>> {
    let env = to_json(&edits.env)?;
    edits.env.clear();
    let nodes_and_mounts = to_json(&edits)?;
    let mut tail = Vec::with_capacity(env.len() + nodes_and_mounts.len() + 4);
    append_items(&mut tail, inner(&env, b'[', b']')?);
    tail.push(b']');
    append_items(&mut tail, inner(&nodes_and_mounts, b'{', b'}')?);
    tail.extend_from_slice(b"}}");
    Ok(tail)
}

/// Appends `,<items>` unless `items` is empty.
fn append_items(out: &mut Vec<u8>, items: &[u8]) {
    if !items.is_empty() {
        out.push(b',');
        out.extend_from_slice(items);
    }
}

/// `json` without its enclosing `open` and `close` bytes.
fn inner(json: &[u8], open: u8, close: u8) -> Result<&[u8]> {
    json.strip_prefix(&[open])
        .and_then(|rest| rest.strip_suffix(&[close]))
        .ok_or_else(|| unexpected_json("common edits", &[open, close]))
}

fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|source| Error::Json {
        what: "encode CDI spec",
        source,
    })
}

/// serde_json's output did not have the shape the splice relies on: the spec types changed
/// without this module following.
fn unexpected_json(what: &str, expected: &[u8]) -> Error {
    Error::InvalidCdiSpec(format!(
        "encoded {what} is not delimited by {:?} as the spec encoder expects",
        String::from_utf8_lossy(expected)
    ))
}
