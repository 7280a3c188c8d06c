//! `kerf-test-gpu-tools`: the program of `kerf-fake-gpu-tools` (fake `nvidia-cuda-mps-control`
//! and `nvidia-smi`) built as a binary of kerf-tests, so that this package's integration tests
//! get its path (`CARGO_BIN_EXE_kerf-test-gpu-tools`); see `kerf_fake_gpu_tools`. The fakes
//! choose their tool by the name they run as, so the binary's own name does not matter.

fn main() {
    let code = kerf_fake_gpu_tools::run(std::env::args_os().collect(), std::io::stdin());
    std::process::exit(code);
}
