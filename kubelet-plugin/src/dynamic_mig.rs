//! Dynamic MIG: MIG devices created when a claim allocated one of a GPU's published
//! placements is prepared, and destroyed at its unprepare.
//!
//! [`control::MigControl`] is the seam to the driver: NVML on a GPU node, the emulated
//! instances of `kerf-fake-gpu-tools` in mock mode ([`mock::MockMigControl`]).
//! [`manager::DynamicMig`] creates and destroys instances for the preparer, crash-safely, and
//! reconciles them with the checkpoint at start-up ([`startup`]).

pub mod control;
pub mod crash;
pub mod manager;
pub mod metrics;
pub mod mock;
pub mod node;
pub mod nvml;
pub mod startup;

pub use crash::CrashStep;
pub use manager::DynamicMig;
