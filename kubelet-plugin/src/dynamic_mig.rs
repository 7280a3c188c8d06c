//! Dynamic MIG: MIG devices created when a claim allocated one of a GPU's published
//! placements is prepared, and destroyed at its unprepare.
//!
//! [`control::MigControl`] is the seam to the driver: NVML on a GPU node, the emulated
//! instances of `kerf-fake-gpu-tools` in mock mode ([`mock::MockMigControl`]).
//! [`manager::DynamicMig`] creates and destroys instances for the preparer, crash-safely, and
//! reconciles them with the checkpoint at start-up ([`startup`]).

pub(crate) mod control;
pub(crate) mod manager;
pub(crate) mod metrics;
pub(crate) mod mock;
pub(crate) mod node;
pub(crate) mod nvml;
pub(crate) mod startup;

pub(crate) use manager::DynamicMig;
