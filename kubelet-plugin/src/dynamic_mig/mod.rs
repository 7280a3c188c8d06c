//! Dynamic MIG: MIG devices created when a claim allocated one of a GPU's published
//! placements is prepared, and destroyed at its unprepare.
//!
//! [`control::MigControl`] is the seam to the driver: NVML on a GPU node, the emulated
//! instances of `kerf-fake-gpu-tools` in mock mode.

pub mod control;
