//! kerf-controller: the control-plane controller (GpuClass -> DeviceClass, slice allocation).
//!
//! The allocation controller arrives with its own issue; this crate holds its place in the
//! workspace so that dependency directions are fixed from the start.
