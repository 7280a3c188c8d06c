//! The prepare's cache-miss path: a claim the watch-fed cache cannot answer for is read from
//! the API server, raced against the watch, and a stale answer never prepares the wrong
//! devices. `miss_path_breakdown` (ignored: a measurement, not a check) times each step of
//! the miss path against the in-memory API server over real HTTP.

#![allow(
    clippy::needless_pass_by_value,
    clippy::cast_precision_loss,
    reason = "fixtures take JSON values as the tests write them inline; figures are printed as f64"
)]

mod miss_breakdown;
