//! KEP-3063 allocation of GPU slices on `resource.k8s.io/v1`: the ResourceClaim reconciler.
//!
//! For claims whose requests use a controller-class DeviceClass of this driver, the controller
//! waits for a pod that uses the claim (WaitForFirstConsumer), places all of that pod's
//! controller claims together on one node with [`kerf_core::alloc::place`], and writes each
//! claim's `status.allocation` (results, a `GpuSliceAllocation` config, a `nodeSelector` for
//! the node and `allocationTimestamp`) behind its finalizer. The kube-scheduler honours such
//! allocations and only adds the pod to `reservedFor` (see `shared/reference/dra-api.md` §5).
//!
//! It yields to the scheduler (a device the scheduler allocated exclusively is given up by a
//! not-yet-reserved controller claim), remembers nodes the scheduler rejected (an allocation it
//! cleared), and deallocates claims that are deleted or that no live pod uses any more. Why a
//! pod's claims are not allocated is said in Events and in the pod condition
//! [`CONDITION_TYPE`] (False); the condition turns True once they are allocated, but a pod
//! allocated at the first attempt gets none: the removed gate and the claims' `Allocated`
//! Events say it, without a pod status write in the middle of the scheduling path.
//!
//! Where things are: the decision tree is [`reconcile()`] (`reconcile.rs`); a pod's claims are
//! allocated together in `allocate.rs`, placed in `placement.rs` (on a node the pod fits as
//! kube-scheduler filters nodes: `nodes.rs`, and the node's pods' requests and host ports kept
//! by `node_usage.rs`) and written (or rolled back,
//! or deallocated) in `commit.rs`; yielding to the scheduler is `yielding.rs`; Events and the
//! pod condition are worded in `report.rs`; the watches are wired in `watch.rs`; the node label
//! the kubelet plugins watch their claims by is kept by `node_label.rs`, on the claim store. All
//! bookkeeping — capacity assumed for writes in flight, which claims are being written,
//! allocations the controller cleared itself, rejected nodes, claims waiting for capacity —
//! is one private bookkeeping (`bookkeeping.rs`) whose write guard undoes itself when dropped. For the
//! metrics, `fragmentation.rs` measures each node pool, `usage.rs` each GPU's fill and the
//! claims left waiting, and `pod_latency.rs` times each pod's wait for its claims.

mod allocate;
mod bookkeeping;
mod commit;
pub mod consumers;
pub(crate) mod context;
mod fragmentation;
mod gate;
mod idle_gpus_taint;
pub(crate) mod index;
pub(crate) mod node_label;
pub(crate) mod node_usage;
pub(crate) mod nodes;
pub mod ownership;
mod placement;
pub(crate) mod pod_index;
mod pod_kinds;
mod pod_latency;
pub mod reasons;
pub(crate) mod reconcile;
mod report;
mod state;
mod usage;
mod watch;
pub(crate) mod write;
mod yielding;

pub use crate::config::ClaimSettings;
pub use context::ClaimsContext;
pub use reconcile::{RETRY, reconcile};
pub use watch::run;

pub use kerf_api::controller_claims::{ALLOCATED_NODE_ANNOTATION, FINALIZER, POD_CONDITION_TYPE};
