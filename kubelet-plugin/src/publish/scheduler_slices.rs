//! Scheduler slices in the publisher: the Node's shared publication
//! ([`kerf_api::shared_publication`]), the `DRAConsumableCapacity` probe, and the API-limit check
//! of every slice before it is written.
//!
//! The publication is read from the same Node object (and the same watch) as the ownership
//! record. A GPU is published shareable only when the publication names it, the record gives
//! it to the scheduler, and the API server keeps `allowMultipleAllocations` (probed once, by a
//! dry-run create, the first time the publication names a GPU; a server that drops the field,
//! Kubernetes 1.34/1.35 or the gate off, gets every GPU whole and one log line).
//!
//! The preparer reads the publication through a [`SharedPublicationHandle`] that the publisher
//! keeps current: the sharing a share is prepared with when its claim's configs name none is
//! the one the Node says at prepare time (the allocation carries no sharing of its own).

use std::sync::{Arc, PoisonError, RwLock};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use kerf_api::features::{self, ApiFeature, Probed};
use kerf_api::ownership::Owner;
use kerf_api::resourceslice::limits::{self, MAX_DEVICES_PER_SLICE_WITH_COUNTERS};
use kerf_api::resourceslice::scheduler_slices::publish_shared;
use kerf_api::shared_publication::{SHARED_PUBLICATION_ANNOTATION, SharedPublication};
use kube::api::{Api, PostParams};

use super::{FIELD_MANAGER, PublishState, Publisher};
use crate::Result;

/// The Node's shared publication as the publisher last read it, for the preparer.
#[derive(Debug, Clone, Default)]
pub struct SharedPublicationHandle(Arc<RwLock<SharedPublication>>);

impl SharedPublicationHandle {
    /// The publication as last read from the Node (empty before the first read).
    pub fn get(&self) -> SharedPublication {
        // Plain data that stays valid even if a writer panicked.
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, publication: SharedPublication) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = publication;
    }
}

/// What the publisher remembers about scheduler slices.
#[derive(Debug, Default)]
pub(super) struct SchedulerSliceState {
    /// Whether the API server keeps consumable capacity; `None` until probed.
    served: Option<bool>,
    /// The malformed publication value warned about last.
    bad_value: Option<String>,
}

impl Publisher {
    /// The Node's shared publication, kept current by [`Publisher::run`], for the preparer.
    pub fn shared_publication(&self) -> SharedPublicationHandle {
        self.publication.clone()
    }

    /// Takes the shared publication of `node`; `true` when it differs from the one held. A
    /// malformed value is warned about once per distinct value and the last good one is kept.
    pub(super) fn observe_publication(&self, node: &Node) -> bool {
        let annotations = node.metadata.annotations.as_ref();
        match SharedPublication::from_annotations(annotations) {
            Ok(publication) => {
                self.state().scheduler_slices.bad_value = None;
                let changed = self.publication.get() != publication;
                self.publication.set(publication);
                changed
            }
            Err(err) => {
                let value = annotations
                    .and_then(|a| a.get(SHARED_PUBLICATION_ANNOTATION))
                    .cloned()
                    .unwrap_or_default();
                let mut state = self.state();
                if state.scheduler_slices.bad_value.as_ref() != Some(&value) {
                    tracing::warn!(
                        node = %self.node_name,
                        annotation = SHARED_PUBLICATION_ANNOTATION,
                        error = %err,
                        "malformed shared publication on the Node; keeping the last good one"
                    );
                    state.scheduler_slices.bad_value = Some(value);
                }
                false
            }
        }
    }

    /// Probes consumable capacity the first time the publication names a GPU of the
    /// scheduler; afterwards (and while no GPU needs it) it does nothing.
    pub(super) async fn probe_consumable_capacity(&self) {
        let needed = {
            let state = self.state();
            state.scheduler_slices.served.is_none() && wants_shared(&state, &self.publication.get())
        };
        if !needed {
            return;
        }
        let probed = probe(&self.slices, &self.driver, &self.node_name).await;
        log_probe(&probed);
        self.state().scheduler_slices.served = Some(probed.is_served());
    }

    /// Makes the publication's GPUs shareable when the server keeps consumable capacity, then
    /// checks every slice against the API limits; a slice with too many devices is split.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Api`] when a slice breaks another API limit: publishing it would fail.
    pub(super) fn finish_specs(
        &self,
        specs: Vec<ResourceSliceSpec>,
    ) -> Result<Vec<ResourceSliceSpec>> {
        let mut specs = specs;
        let state = self.state();
        if state.scheduler_slices.served == Some(true) {
            let publication = self.publication.get();
            for err in publish_shared(&mut specs, &state.record, &publication) {
                tracing::error!(error = %err, "cannot publish a GPU as shareable; publishing it whole");
            }
        }
        drop(state);
        check_limits(specs)
    }
}

/// Whether the publication names a GPU that the ownership record gives to the scheduler.
fn wants_shared(state: &PublishState, publication: &SharedPublication) -> bool {
    publication
        .0
        .keys()
        .any(|device| state.record.owner(device) == Some(Owner::Scheduler))
}

fn log_probe(probed: &Probed) {
    match probed.degraded_message(ApiFeature::ConsumableCapacity) {
        None => tracing::info!(
            "the API server keeps consumable capacity: GPUs of sliced Scheduler GpuClasses are published as scheduler slices"
        ),
        Some(line) => tracing::info!("{line}"),
    }
}

/// A dry-run create of [`features::consumable_capacity_probe`].
async fn probe(slices: &Api<ResourceSlice>, driver: &str, node: &str) -> Probed {
    let params = PostParams {
        dry_run: true,
        field_manager: Some(FIELD_MANAGER.to_owned()),
    };
    match slices
        .create(&params, &features::consumable_capacity_probe(driver, node))
        .await
    {
        Ok(answer) => features::kept_consumable_capacity(&answer),
        Err(e) => Probed::Failed(e.to_string()),
    }
}

/// Checks every slice ([`limits::check_slice`]); a slice with more devices than the limit for
/// its kind is logged as an error and split, anything else fails the publish.
fn check_limits(specs: Vec<ResourceSliceSpec>) -> Result<Vec<ResourceSliceSpec>> {
    let mut checked = Vec::with_capacity(specs.len());
    let mut split = false;
    for spec in specs {
        match limits::check_slice(&spec) {
            Ok(()) => checked.push(spec),
            Err(err) => {
                let devices = spec.devices.as_deref().unwrap_or_default();
                if devices.len() <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS {
                    return Err(err.into());
                }
                tracing::error!(error = %err, "a ResourceSlice breaks an API limit; splitting it");
                split = true;
                for chunk in devices.chunks(MAX_DEVICES_PER_SLICE_WITH_COUNTERS) {
                    let part = ResourceSliceSpec {
                        devices: Some(chunk.to_vec()),
                        ..spec.clone()
                    };
                    limits::check_slice(&part)?;
                    checked.push(part);
                }
            }
        }
    }
    if split {
        let count = i64::try_from(checked.len()).unwrap_or(i64::MAX);
        for spec in &mut checked {
            spec.pool.resource_slice_count = count;
        }
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{Device, DeviceTaint, ResourcePool};

    use super::*;

    #[test]
    fn a_slice_over_the_device_limit_is_split_and_the_pool_recounted() {
        let device = |i: usize| Device {
            name: format!("gpu-{i}"),
            taints: Some(vec![DeviceTaint {
                key: "k".to_owned(),
                effect: "NoSchedule".to_owned(),
                ..DeviceTaint::default()
            }]),
            ..Device::default()
        };
        let spec = ResourceSliceSpec {
            driver: "gpu.kerf.dev".to_owned(),
            pool: ResourcePool {
                name: "n".to_owned(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some((0..100).map(device).collect()),
            ..ResourceSliceSpec::default()
        };
        let checked = check_limits(vec![spec]).unwrap();
        assert_eq!(checked.len(), 2);
        assert_eq!(checked[0].devices.as_ref().unwrap().len(), 64);
        assert!(checked.iter().all(|s| s.pool.resource_slice_count == 2));
    }
}
