//! `kerf-fake-gpu-tools`: fake `nvidia-cuda-mps-control`, `nvidia-smi` and CUDA client
//! (`kerf-fake-cuda-client`) for machines without a GPU, chosen by the name the program runs
//! as (see the `kerf_fake_gpu_tools` library).
//! Install it into a mock driver root with `kerf_fake_gpu_tools::install`, or as the image
//! does, as `<root>/usr/bin/<tool>` links or copies.

fn main() {
    let code = kerf_fake_gpu_tools::run(std::env::args_os().collect(), std::io::stdin());
    std::process::exit(code);
}
