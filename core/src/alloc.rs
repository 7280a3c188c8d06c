//! The controller's allocator: placement of GPU slices and whole GPUs by claim parameters.
//!
//! Pure and synchronous. The controller feeds an [`Index`] from its watches (inventory per
//! node from kerf's ResourceSlices, usage per claim from every allocation, whoever wrote it)
//! and asks [`place`] where a pod's claims go. Nothing here allocates per GPU per decision
//! beyond small reused buffers, so decisions stay well under a millisecond on thousands of
//! GPUs.
//!
//! - [`model`]: [`NodeGpus`], [`GpuInfo`], [`DeviceUse`].
//! - [`taint`]: device taints and request tolerations, matched as kube-scheduler does.
//! - [`request`]: [`PodRequest`] and what each request asks for.
//! - [`Index`]: free capacity per GPU, updated incrementally.
//! - [`node_fit`]: whether a pod's CPU, memory and other node resources fit, as kube-scheduler
//!   decides it.
//! - [`place`] / [`place_where`]: the placement decision, [`PodPlacement`] or [`Unplaceable`];
//!   [`place_with`] / [`place_where_with`] with the [`PlacementContext`] the default policy,
//!   [`Policy::LeastFragmentation`], needs (without it, it places as BinPack).
//! - [`wants_idle_gpus_taint`]: which nodes should carry kerf's `PreferNoSchedule` taint
//!   [`IDLE_GPUS_TAINT_KEY`], which keeps kube-scheduler's pods without GPUs off nodes with
//!   idle GPUs.
//! - [`Workload`]: the pod kinds seen, learned online, as a [`Distribution`];
//!   [`node_fragmentation`] measures a node's [`Fragmentation`] against it.

mod frag;
mod hash;
mod idle_taint;
mod index;
pub mod model;
pub mod node_fit;
mod place;
mod prioritized;
pub mod request;
mod steer;
pub mod taint;
mod unplaceable;
mod workload;

pub use frag::{
    Distribution, Fragmentation, HostAmounts, HostState, TaskShape, node_fragmentation,
};
pub use idle_taint::{
    IDLE_GPUS_TAINT_EFFECT, IDLE_GPUS_TAINT_KEY, idle_gpu_counts, wants_idle_gpus_taint,
};
pub use index::{GpuUsage, GpuView, Index, MpsSizes, NodeView};
pub use model::{
    ClaimPlacement, DeviceUse, GpuInfo, NodeGpus, PlacedDevice, PodPlacement, SliceSize, UseKind,
};
pub use place::{
    PlacementContext, place, place_where, place_where_with, place_with, place_without_gpus,
};
pub use request::{
    ClaimRequest, DeviceRequest, GpuSelector, MAX_SUBREQUESTS, PodRequest, Policy, TopologyScope,
};
pub use steer::default_score;
pub use taint::{DeviceTaint, TaintEffect, Toleration, TolerationOperator};
pub use unplaceable::{Unplaceable, UnplaceableReason};
pub use workload::Workload;
