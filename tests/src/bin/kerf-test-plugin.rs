//! `kerf-test-plugin`: `kerf-kubelet-plugin`'s program under another name, for tests that must
//! kill the plugin (SIGKILL) and start it again: the same library calls
//! ([`kerf_kubelet_plugin::launch`], [`kerf_kubelet_plugin::run`]), so the same flags, the
//! same `mps-control-daemon` subcommand and `--init`, logs on stderr (which the tests
//! capture), the API server from `KUBECONFIG`.
//!
//! It lives in kerf-tests because Cargo builds a package's own binaries for that package's
//! integration tests (`CARGO_BIN_EXE_kerf-test-plugin`), but not another package's. The one
//! difference from `kerf-kubelet-plugin`'s `main`: the system allocator instead of mimalloc,
//! which changes how fast prepares run, not what they do.

use kerf_kubelet_plugin::Launched;
use kerf_kubelet_plugin::args::Args;

fn main() -> anyhow::Result<()> {
    match kerf_kubelet_plugin::launch(std::env::args_os().collect())? {
        Launched::Exit(code) => std::process::exit(code),
        Launched::Plugin(args) => run(*args),
    }
}

#[tokio::main]
async fn run(args: Args) -> anyhow::Result<()> {
    Ok(kerf_kubelet_plugin::run(args).await?)
}
