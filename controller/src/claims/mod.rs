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
//! cleared), and deallocates claims that are deleted or that no live pod uses any more.

pub mod consumers;
pub mod context;
pub mod index;
pub mod nodes;
pub mod reconcile;
pub mod write;

pub use context::{ClaimSettings, ClaimsContext};
pub use reconcile::{error_policy, reconcile, run};

/// The finalizer that keeps a claim until the controller has deallocated it.
pub const FINALIZER: &str = "gpu.kerf.dev/allocation";

/// Annotation naming the node the controller allocated a claim on: how a later reconcile
/// tells "the scheduler cleared our allocation" from "never allocated".
pub const ALLOCATED_NODE_ANNOTATION: &str = "gpu.kerf.dev/allocated-node";
