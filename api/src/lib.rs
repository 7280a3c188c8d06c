//! kerf-api: kerf's Kubernetes-facing types and conversions.
//!
//! - [`params`]: the opaque parameter kinds (`GpuClaimParameters`, `GpuClassParameters`,
//!   `GpuSliceAllocation`) and [`decode_opaque`], their one strict decoder.
//! - `claim.rs`: [`resolve_allocation`], what an allocated ResourceClaim gives this driver;
//!   [`claim_node_label`]: the label naming the node a claim is allocated on.
//! - [`resourceslice`]: [`resource_slices`], the node's inventory as ResourceSlices.
//! - [`gpuclass`]: the GpuClass custom resource.
//! - [`gpuquota`]: the GpuQuota custom resource and what a claim is charged against it.
//! - [`crd`]: the generated CRD manifests (written to `deploy/helm/kerf/crds/` by the `crdgen` binary).
//! - [`features`]: probes of the optional API fields the server keeps (device taints, extended
//!   resource names).
//! - [`quantity`]: byte quantities (`40Gi`) parsed exactly.
//! - [`pod_resources`]: a Pod's requests and host ports and a Node's allocatable, as
//!   kube-scheduler reads them, in kerf-core's amounts.
//! - [`inventory_view`](mod@inventory_view): [`node_gpus_from_slices`], the controller's
//!   inventory read back from kerf's ResourceSlices.
//! - [`ownership`]: which of kube-scheduler and kerf-controller may allocate each device.
//! - [`allocation`]: claims for the controller's allocator: [`claim_request`], [`device_uses`],
//!   [`allocation_status`].
//! - [`shared_publication`]: the Node annotation naming the GPUs published as shareable
//!   (scheduler slices) and their slicing.
//! - [`counters`]: kube-scheduler's shared-counter rule for partitionable devices.
//! - [`claim_status`]: what a claim's status says: its allocation and its consumers.
//! - [`watch_backoff`]: how soon the watches of both binaries retry after the API server
//!   stopped answering.

pub mod allocation;
mod claim;
pub mod claim_node_label;
pub mod claim_status;
pub mod controller_claims;
pub mod counters;
pub mod crd;
pub mod device_status;
mod error;
pub mod features;
pub mod gpuclass;
pub mod gpuquota;
mod group;
pub mod inventory_view;
pub mod node_pool;
pub mod node_selection;
pub mod ownership;
pub mod params;
pub mod pod_resources;
pub mod quantity;
pub mod resourceslice;
mod schema;
pub mod shared_publication;
pub mod watch_backoff;
pub mod write_failure;

pub use allocation::{allocation_status, claim_request, device_uses};
pub use claim::{AllocatedDevice, claim_requests, resolve_allocation};
pub use error::{Error, Result};
pub use gpuclass::{GpuClass, GpuClassSpec, GpuClassStatus};
pub use gpuquota::{GpuQuota, GpuQuotaSpec, GpuQuotaStatus};
pub use group::{API_VERSION, GROUP, VERSION};
pub use inventory_view::{inventory_view, node_gpus_from_slices};
pub use params::{
    Allocator, ControllerPlacement, GpuClaimParameters, GpuClassParameters, GpuSelector,
    GpuSliceAllocation, OpaqueConfig, OpaqueKind, PlacementPolicy, SharingConfig, SliceDevice,
    Slicing, Topology, TopologyScope, decode_opaque,
};
pub use resourceslice::{resource_slices, slice_name};
