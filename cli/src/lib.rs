//! kerf-cli: the commands behind the `kerf` binary.

pub mod inventory;
