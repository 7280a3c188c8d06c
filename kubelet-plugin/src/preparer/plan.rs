//! How a prepare turns a claim's allocation results into device records, and how it reserves
//! them against every other prepared claim.

use kerf_api::AllocatedDevice;
use kerf_core::cdi;
use kerf_core::checkpoint::{ClaimEntry, ClaimState, DeviceRecord};
use kerf_core::inventory::{DeviceRef, DynamicPlacement};

use super::records::{
    check_within_claim, conflicts, device_record, finished_share, name_shares, parent_request,
};
use super::{ClaimRef, Preparer};
use crate::Result;
use crate::prepare_error::PrepareError;

impl Preparer {
    /// Turns the allocation results into device records, checking every device against
    /// this node's inventory.
    pub(super) fn plan_devices(
        &self,
        claim: &ClaimRef,
        allocated: &[AllocatedDevice],
    ) -> Result<Vec<DeviceRecord>> {
        let mut records: Vec<DeviceRecord> = Vec::new();
        // Read once, so every share of the claim sees the same publication.
        let publication = self.publication.get();
        for (index, device) in allocated.iter().enumerate() {
            let (found, placement) = self.find_device(index, device)?;
            let finished;
            let device = if device.share.is_some() {
                finished = finished_share(found, device, &publication)?;
                &finished
            } else {
                device
            };
            let request = parent_request(&device.request).to_owned();
            if add_request(&mut records, device, &request) {
                continue;
            }
            let cdi_id = cdi::qualified_name(
                &self.config.cdi_kind,
                &cdi::claim_device_name(&claim.uid, &device.device),
            );
            let mut record = device_record(found, device, request, cdi_id);
            if let Some(placement) = &placement {
                crate::dynamic_mig::manager::mark_intent(&mut record, placement);
            }
            check_within_claim(claim, index, &records, &record)?;
            records.push(record);
        }
        name_shares(&mut records, &self.config.cdi_kind, &claim.uid);
        Ok(records)
    }

    /// The inventory's device for allocation result `index`, and its dynamic-MIG placement
    /// when it is one; refused when the result names another node's pool, a device this
    /// node does not have, or a GPU other than the one the allocation expects.
    fn find_device<'a>(
        &'a self,
        index: usize,
        device: &AllocatedDevice,
    ) -> Result<(DeviceRef<'a>, Option<DynamicPlacement<'a>>)> {
        let node = &self.config.node_name;
        if device.pool != *node {
            return Err(PrepareError::OtherNodePool {
                index,
                pool: device.pool.clone(),
                node: node.clone(),
            }
            .into());
        }
        let placement = self.inventory.dynamic_placement(&device.device);
        let Some(found) = self
            .inventory
            .device(&device.device)
            .or(placement.map(|p| DeviceRef::Gpu(p.gpu)))
        else {
            return Err(PrepareError::UnknownDevice {
                index,
                device: device.device.clone(),
                node: node.clone(),
            }
            .into());
        };
        if let Some(expected) = &device.expected_gpu_uuid
            && found.gpu().uuid != *expected
        {
            return Err(PrepareError::GpuMismatch {
                device: device.device.clone(),
                expected: expected.clone(),
                node: node.clone(),
                actual: found.gpu().uuid.clone(),
            }
            .into());
        }
        Ok((found, placement))
    }

    /// Checks exclusivity against every other prepared claim and records the claim as
    /// PrepareStarted in memory, atomically with respect to other prepares. Not waiting for
    /// this to be written saves one checkpoint write per prepare (see the module docs for why a crash
    /// here loses nothing); a side effect that start-up could not find again would have to
    /// wait for it.
    pub(super) fn record_started(
        &self,
        claim: &ClaimRef,
        pod_claim_name: Option<String>,
        devices: &mut [DeviceRecord],
    ) -> Result<()> {
        let conflict = self.checkpoint.mutate_lazily(|cp| {
            let conflict = devices.iter().find_map(|wanted| {
                cp.claims
                    .iter()
                    .filter(|(uid, _)| **uid != claim.uid)
                    .find_map(|(uid, entry)| {
                        entry
                            .devices
                            .iter()
                            .find(|held| {
                                held.device_name == wanted.device_name && conflicts(held, wanted)
                            })
                            .map(|_| PrepareError::DeviceHeld {
                                device: wanted.device_name.clone(),
                                holder_uid: uid.clone(),
                                holder_namespace: entry.namespace.clone(),
                                holder_name: entry.name.clone(),
                            })
                    })
            });
            if conflict.is_none() {
                crate::dynamic_mig::manager::carry_over(cp.claims.get(&claim.uid), devices);
                cp.claims.insert(
                    claim.uid.clone(),
                    ClaimEntry {
                        namespace: claim.namespace.clone(),
                        name: claim.name.clone(),
                        pod_claim_name,
                        state: ClaimState::PrepareStarted,
                        devices: devices.to_vec(),
                    },
                );
            }
            conflict
        });
        if let Some(held) = conflict {
            return Err(held.into());
        }
        self.update_prepared_gauge();
        Ok(())
    }
}

/// Adds `device`'s request to the record of the same device and share, if `records` has one
/// (one record per device and share: two shares of one GPU are two devices); false if not.
fn add_request(records: &mut [DeviceRecord], device: &AllocatedDevice, request: &str) -> bool {
    let Some(existing) = records
        .iter_mut()
        .find(|r| r.device_name == device.device && r.share_id == device.share_id)
    else {
        return false;
    };
    if !existing.request_names.iter().any(|name| name == request) {
        existing.request_names.push(request.to_owned());
    }
    if !existing.request_refs.contains(&device.request) {
        existing.request_refs.push(device.request.clone());
    }
    true
}
