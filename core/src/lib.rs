//! kerf-core: the pure domain of kerf, with no Kubernetes client, gRPC or async runtime.
//!
//! - [`inventory`]: the GPU inventory model (GPUs, MIG devices, driver version).
//! - [`mock`]: named mock inventories and the YAML inventory file format.
//! - [`names`]: validation of names that come from outside and end up in paths.
//! - [`fsutil`]: atomic, durable file writes.
//! - [`cdi`]: the CDI spec model, its version rules and the per-claim spec generator.
//! - [`driver_root`]: discovery of driver libraries and binaries to mount into containers.
//! - [`sharing`]: how a prepared device is shared, and the limits of its slice.
//! - [`enforcement`]: who holds a slice's limits, and the limits of a GPU's MPS server.
//! - [`checkpoint`]: the kubelet plugin's versioned, tolerant checkpoint format.
//! - [`alloc`]: the controller's allocator: free-capacity index and pod placement.
//! - [`mps`]: CUDA MPS daemon directories and client mounts, compute modes and time slices.
//! - [`health`]: device faults, device health and the taints unhealthy devices get.
//! - [`mig_catalog`]: MIG profiles, placements and shared counters of dynamic MIG.
//! - [`mig_reconcile`]: which MIG instances a restarted plugin keeps, destroys or forgets.
//! - [`rng`]: the seeded random sequence of the stand-in, the benchmarks and the tests.

pub mod alloc;
pub mod cdi;
pub mod checkpoint;
pub mod driver_root;
pub mod enforcement;
mod error;
pub mod fsutil;
pub mod health;
pub mod inventory;
pub mod mig_catalog;
pub mod mig_reconcile;
pub mod mock;
pub mod mps;
pub mod names;
pub mod rng;
pub mod sharing;

pub use error::{Error, Result};
