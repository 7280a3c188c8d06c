//! The files a prepared claim puts on the node besides its checkpoint entry: its CDI spec and
//! its device metadata files, written and removed together.

use std::path::{Path, PathBuf};

use kerf_core::cdi::{self, ClaimSpec};
use kerf_core::checkpoint::DeviceRecord;

use super::records::spec_device_name;
use super::{ClaimRef, Preparer};
use crate::Result;

impl Preparer {
    /// Writes the claim's metadata files and CDI spec from its checkpoint record alone, so
    /// that a repeated prepare and the restoration at start-up produce the same paths.
    pub(super) async fn write_cdi_spec(
        &self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        devices: &[DeviceRecord],
    ) -> Result<()> {
        let clients = self.sharing.clients(devices)?;
        let prepared: Vec<cdi::PreparedDevice> = devices
            .iter()
            .zip(clients)
            .map(|(device, mps)| cdi::PreparedDevice {
                mps,
                ..device.prepared_device()
            })
            .collect();
        let requests: Vec<Vec<String>> = devices.iter().map(|d| d.request_names.clone()).collect();
        let request_refs: Vec<Vec<String>> =
            devices.iter().map(|d| d.request_refs.clone()).collect();
        let metadata_dir = self.metadata_dir();
        let workload = cdi::ClaimWorkload {
            driver: &self.config.driver_name,
            pool: &self.config.node_name,
            requests: &requests,
            request_refs: &request_refs,
            pod_claim_name,
            metadata_dir: &metadata_dir,
        };
        let spec = ClaimSpec {
            claim_uid: &claim.uid,
            claim_namespace: &claim.namespace,
            claim_name: &claim.name,
            devices: &prepared,
        };
        // The metadata files name the published devices; the spec's devices are named as
        // their recorded CDI IDs are (several shares of one GPU each get their own).
        let files = cdi::metadata_files(&spec, &workload)?;
        let renamed = self.renamed_for_spec(claim, devices, &prepared);
        let spec = ClaimSpec {
            devices: renamed.as_deref().unwrap_or(&prepared),
            ..spec
        };
        let encoded = self.encoder.encode_for_workload(&spec, &workload)?;
        let name = cdi::transient_spec_file_name(&self.config.cdi_kind, &claim.uid)?;
        let uid = claim.uid.clone();
        // The files exist before the spec that mounts them can be used.
        self.specs
            .write_after(name, encoded.bytes, move || {
                cdi::write_metadata_files(&metadata_dir, &uid, &files).map(|_| ())
            })
            .await
    }

    /// `prepared` with each device named as its record's CDI ID says, when any record names
    /// its spec device otherwise (several shares of one GPU); `None` when none does.
    fn renamed_for_spec(
        &self,
        claim: &ClaimRef,
        devices: &[DeviceRecord],
        prepared: &[cdi::PreparedDevice],
    ) -> Option<Vec<cdi::PreparedDevice>> {
        let kind = &self.config.cdi_kind;
        devices
            .iter()
            .any(|d| spec_device_name(d, kind, &claim.uid).is_some())
            .then(|| {
                prepared
                    .iter()
                    .zip(devices)
                    .map(|(device, record)| cdi::PreparedDevice {
                        name: spec_device_name(record, kind, &claim.uid)
                            .map_or_else(|| device.name.clone(), str::to_owned),
                        ..device.clone()
                    })
                    .collect()
            })
    }

    /// Removes the claim's spec, then the metadata files it mounted.
    pub(super) async fn remove_cdi_spec(&self, uid: &str) -> Result<()> {
        let name = cdi::transient_spec_file_name(&self.config.cdi_kind, uid)?;
        let metadata_dir = self.metadata_dir();
        let uid = uid.to_owned();
        self.specs
            .remove_then(name, move || {
                cdi::remove_metadata_files(&metadata_dir, &uid).map(|_| ())
            })
            .await
            .map(|_| ())
    }

    /// The host directory of the claims' device metadata files: `dra-device-metadata` beside
    /// the checkpoint (in the plugin directory, as upstream's kubelet plugin library keeps
    /// them), a path the kubelet's host and the plugin's container share.
    pub(super) fn metadata_dir(&self) -> PathBuf {
        self.checkpoint
            .path()
            .parent()
            .unwrap_or_else(|| Path::new("."))
            .join(cdi::METADATA_HOST_SUBDIR)
    }
}
