//! `kerf-controller`: parses the flags and runs [`kerf_controller::run`] until SIGTERM or
//! Ctrl-C.

use clap::Parser;
use kerf_controller::args::Args;

// mimalloc while the feature `mimalloc` (on by default) is on; why: `kerf_ops::allocator`.
kerf_ops::global_allocator!();

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Ok(kerf_controller::run(Args::parse()).await?)
}
