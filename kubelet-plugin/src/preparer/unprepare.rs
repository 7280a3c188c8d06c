//! Unprepare of one claim: its CDI spec and its checkpoint entry removed, its shared GPUs
//! released, its waiting status write cancelled.

use kerf_core::checkpoint::{ClaimEntry, DeviceRecord};
use kerf_core::names;

use super::{ClaimRef, Preparer};
use crate::Result;
use crate::crash::{CrashStep, crash_point};

impl Preparer {
    /// Unprepares one claim: removes its CDI spec and its checkpoint entry. Needs no API
    /// call, because the claim may already be gone.
    ///
    /// # Errors
    /// The UID is not a valid UID, or the spec or checkpoint could not be updated.
    pub(super) async fn unprepare_claim(&self, claim: &ClaimRef) -> Result<()> {
        names::claim_uid("claim.uid", &claim.uid)?;
        let _guard = self.locks.lock(&claim.uid).await;
        let (known, entry) = self.checkpoint.read(|cp| {
            let entry = cp.claims.get(&claim.uid).cloned();
            let known = entry.is_some() || cp.undecodable.contains_key(&claim.uid);
            (known, entry)
        });
        if !known {
            return Ok(());
        }
        let _operation = self.checkpoint.operation().await?;
        let devices = match entry {
            Some(entry) if entry.devices.iter().all(|d| d.mig_instance.is_none()) => {
                self.remove_spec_and_entry(claim, entry).await?
            }
            entry => {
                let devices = entry.map(|e| e.devices).unwrap_or_default();
                self.remove_spec_then_entry(claim, &devices).await?;
                devices
            }
        };
        crash_point(self.crash_at, CrashStep::AfterEntryRemove);
        self.update_prepared_gauge();
        self.claim_reader.unprepared(&claim.uid);
        self.sharing.release(&devices, &self.checkpoint).await;
        if let Some(writer) = &self.device_status {
            writer.forget(claim);
        }
        Ok(())
    }

    /// Removes the spec and the entry of a claim without MIG instances at the same time, and
    /// returns its devices. Either order is safe in a crash: a spec without an entry is
    /// removed at start-up, an entry without a spec gets it back and the kubelet's retried
    /// unprepare removes both. A failed spec removal puts the entry back, so that the retry
    /// still finds the spec to remove.
    async fn remove_spec_and_entry(
        &self,
        claim: &ClaimRef,
        entry: ClaimEntry,
    ) -> Result<Vec<DeviceRecord>> {
        let devices = entry.devices.clone();
        let spec = async {
            let removed = self.remove_cdi_spec(&claim.uid).await;
            crash_point(self.crash_at, CrashStep::AfterSpecRemove);
            removed
        };
        let forgotten = self.checkpoint.update(|cp| cp.remove_claim(&claim.uid));
        let (spec, forgotten) = tokio::join!(spec, forgotten);
        forgotten?;
        if let Err(e) = spec {
            let restored = self
                .checkpoint
                .update(|cp| cp.claims.insert(claim.uid.clone(), entry))
                .await;
            if let Err(restore) = restored {
                tracing::error!(claim.uid = %claim.uid, error = %restore, "unprepare: putting the entry back after a failed spec removal failed; start-up removes the spec");
            }
            return Err(e);
        }
        Ok(devices)
    }

    /// Removes the spec, then releases the MIG instances, then the entry: a MIG instance
    /// still in use fails the unprepare with the entry kept, so that the kubelet retries and
    /// the instance is never forgotten while it exists. Undecodable entries go this way too.
    async fn remove_spec_then_entry(
        &self,
        claim: &ClaimRef,
        devices: &[DeviceRecord],
    ) -> Result<()> {
        self.remove_cdi_spec(&claim.uid).await?;
        crash_point(self.crash_at, CrashStep::AfterSpecRemove);
        self.mig.release(devices).await?;
        self.checkpoint
            .update(|cp| cp.remove_claim(&claim.uid))
            .await?;
        Ok(())
    }
}
