//! `kerf-fake-gpu-tools`: fake `nvidia-cuda-mps-control` and `nvidia-smi` for machines without
//! a GPU, chosen by the name the program runs as (see `kerf_tests::fake_gpu_tools`). Install
//! it into a mock driver root with `kerf_tests::fake_gpu_tools::install`.

fn main() {
    let code = kerf_tests::fake_gpu_tools::run(std::env::args_os().collect(), std::io::stdin());
    std::process::exit(code);
}
