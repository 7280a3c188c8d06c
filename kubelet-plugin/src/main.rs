//! `kerf-kubelet-plugin`: runs the plugin until SIGTERM or Ctrl-C; as PID 1 (or with
//! `--init=always`) first becomes the plugin's minimal init; `kerf-kubelet-plugin
//! mps-control-daemon …` is the program of an MPS daemon pod instead. All of it is
//! [`kerf_kubelet_plugin::launch`] and [`kerf_kubelet_plugin::run`].

use kerf_kubelet_plugin::Launched;
use kerf_kubelet_plugin::args::Args;

// mimalloc while the feature `mimalloc` (on by default) is on; why: `kerf_ops::allocator`.
kerf_ops::global_allocator!();

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
